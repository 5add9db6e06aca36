"""The event log at the scale of a long run, and what ``trainguard report`` costs on it.

``python -m bench.event_log_scale make DIR --days 7 --ranks 64``
``python -m bench.event_log_scale measure DIR [DIR ...]``

``make`` writes ``DIR/events.jsonl`` with trainguard's own writer (:class:`trainguard.events.EventLog`,
the fields of each event as its callers pass them), its clock and pid replaced so that days of a run
are written in a minute: the lines a ``trainguard run`` job writes, at the ratio it writes them.

* rank 0's ``step`` per training step (the heartbeat), a step a second with 5 % jitter;
* every ``--save-every`` steps a ``save`` of every rank (``policies.py``'s fields), rank 0's
  ``retention_delete`` (``--keep`` checkpoints kept) and, with ``--ram``, its ``ram_persist``;
* a crash every ``--mtbf-h`` hours (seeded): the agent's ``failure`` and ``restart``, a
  ``rendezvous`` per node, new workers (new pids): ``manager_open`` and ``restore`` on every rank,
  rank 0's ``first_step`` with the steps lost, training again from the step restored;
* once a week a hang instead (rank 0's ``hang`` with 4 kB of stacks), and on day 2 a node joins
  (a ``membership`` restart, the world grows by a node).

``measure`` runs ``trainguard report DIR`` (and ``--json``, or ``--plot FILE``) in a child and prints its wall time and
peak RSS (``getrusage(RUSAGE_CHILDREN)`` of that child alone: one child per measurement process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import types

from trainguard import events as events_mod
from trainguard.events import EVENTS_FILE, EventLog

T0 = 1_760_000_000.0


class _Clock:
    """``events.time`` and ``events.os`` while ``make`` writes: simulated time and pids."""

    def __init__(self) -> None:
        self.now = T0
        self.pid = 1

    def time(self) -> float:
        return self.now


def make(out: str, *, days: float, ranks: int, save_every: int, keep: int, mtbf_h: float, ram: bool,
         seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    path = os.path.join(out, EVENTS_FILE)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(path):
        os.remove(path)
    clock = _Clock()
    shim = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    shim.getpid = lambda: clock.pid
    saved = events_mod.time, events_mod.os
    events_mod.time, events_mod.os = clock, shim  # type: ignore[assignment]
    try:
        return _write(path, clock, rng, days=days, ranks=ranks, save_every=save_every, keep=keep,
                      mtbf_h=mtbf_h, ram=ram)
    finally:
        events_mod.time, events_mod.os = saved


def _write(path: str, clock: _Clock, rng: random.Random, *, days: float, ranks: int, save_every: int,
           keep: int, mtbf_h: float, ram: bool) -> dict[str, int]:
    per_node = min(8, ranks)
    world = ranks
    end = T0 + days * 86400
    counts = {"steps": 0, "saves": 0, "failures": 0}
    next_pid = [1000]

    def pid() -> int:
        next_pid[0] += 1
        return next_pid[0]

    agent_pid = pid()
    agent = EventLog(path, rank=-1)

    def as_agent(event: str, **f: object) -> None:
        clock.pid = agent_pid
        agent.emit(event, **f)

    def rendezvous() -> None:
        for n in range(world // per_node):
            clock.now += 0.002
            as_agent("rendezvous", world_size=world, nodes=world // per_node, node_rank=n, seconds=round(rng.uniform(1, 3), 3))

    def start_workers() -> list[tuple[int, EventLog]]:
        procs = [(pid(), EventLog(path, rank=r)) for r in range(world)]
        for p, log in procs:
            clock.pid, clock.now = p, clock.now + 0.001
            log.emit("manager_open", world_size=world, async_save=True)
        return procs

    def restore(procs: list[tuple[int, EventLog]], step: int | None) -> None:
        for p, log in procs:
            clock.pid, clock.now = p, clock.now + 0.0005
            if step is None:
                log.emit("fresh_start", skipped=0)
            else:
                log.emit("restore", step=step, seconds=round(rng.uniform(2, 6), 6),
                         source=f"/shared/ckpt/run1/step-{step:010d}", tier="disk")

    as_agent("agent_start", argv=["train.py", "--config", "big.yaml"], nnodes=f"{world // per_node}",
             nproc_per_node=per_node, rdzv_conf="", faults=[], job_id="week-run-1")
    rendezvous()
    procs = start_workers()
    restore(procs, None)
    step, last_saved, first = 0, None, True
    lost = 0
    next_crash = clock.now + rng.expovariate(1 / (mtbf_h * 3600))
    joined = days < 2  # a node joins on day 2
    hangs_due = [T0 + 86400 * (w * 7 + 4.5) for w in range(int(days // 7) + 1)]
    while clock.now < end:
        step += 1
        clock.now += rng.gauss(1.0, 0.05)
        p0, log0 = procs[0]
        clock.pid = p0
        if first:
            log0.emit("first_step", step=step, world_size=world, lost_steps=lost)
            first = False
        log0.emit("step", step=step, world_size=world)
        counts["steps"] += 1
        if step % save_every == 0:
            stall, dur = rng.uniform(0.02, 0.2), rng.uniform(5, 15)
            for p, log in procs:
                clock.pid, clock.now = p, clock.now + 0.0002
                log.emit("save", step=step, stall_s=round(stall, 6), duration_s=round(dur, 6),
                         stall_call_s=round(stall * 0.7, 6), stall_hook_s=0.0, stall_wait_s=round(stall * 0.3, 6),
                         stall_prev_s=0.0, bytes=70_000_000_000, async_save=True,  # the checkpoint's, on every rank
                         committed_t=round(clock.now - 0.5, 6))
            counts["saves"] += 1
            clock.pid = p0
            if ram:
                log0.emit("ram_persist", step=step, seconds=round(rng.uniform(5, 20), 6))
            if step - keep * save_every > 0:
                log0.emit("retention_delete", step=step - keep * save_every)
            last_saved = step
        if not joined and clock.now > T0 + 86400 * 1.5:  # a node joins: membership restart, one node more
            joined = True
            as_agent("restart", remaining_restarts=100, reason="membership")
            world += per_node
            clock.now += 20
            rendezvous()
            procs = start_workers()
            restore(procs, last_saved)
            lost, step, first = step - (last_saved or 0), last_saved or 0, True
        hang = bool(hangs_due) and clock.now > hangs_due[0]
        if clock.now > next_crash or hang:
            counts["failures"] += 1
            if hang:
                hangs_due.pop(0)
                clock.pid = p0
                log0.emit("hang", step=step, idle_s=612.4, stacks="  File \"train.py\", line 88 in main\n" * 110,
                          waiting_in=None, timeout_s=600.0)
                clock.now += 600
            else:
                next_crash = clock.now + rng.expovariate(1 / (mtbf_h * 3600))
            clock.now += 2
            bad = 0 if hang else rng.randrange(world)
            as_agent("failure", rank=bad, cause="exit 75 (hang)" if hang else "killed by SIGKILL",
                     failures={str(bad): "exit 75 (hang)" if hang else "killed by SIGKILL"})
            as_agent("restart", remaining_restarts=100, reason="failure")
            clock.now += 15
            rendezvous()
            procs = start_workers()
            restore(procs, last_saved)
            lost, step, first = step - (last_saved or 0), last_saved or 0, True
    as_agent("agent_exit", ok=True)
    counts["bytes"] = os.path.getsize(path)
    with open(path, "rb") as f:
        counts["lines"] = sum(1 for _ in f)
    return counts


def measure(run_dir: str, *args: str) -> dict[str, float]:
    """One ``trainguard report RUN_DIR ARGS`` in a child of a fresh process: its wall time and peak RSS."""
    code = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
        "wall = time.perf_counter() - t\n"
        "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': p.returncode, 'wall_s': wall, 'cpu_s': ru.ru_utime + ru.ru_stime,"
        " 'peak_rss_mb': ru.ru_maxrss / 1024, 'stderr': p.stderr.decode()[-500:]}))\n"
    )
    cmd = [sys.executable, "-c", code, sys.executable, "-m", "trainguard.cli", "report", run_dir, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--days", type=float, default=7.0)
    m.add_argument("--ranks", type=int, default=1)
    m.add_argument("--save-every", type=int, default=100)
    m.add_argument("--keep", type=int, default=3)
    m.add_argument("--mtbf-h", type=float, default=48.0)
    m.add_argument("--ram", action="store_true")
    r = sub.add_parser("measure")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--json", action="store_true", help="measure `report --json` too")
    r.add_argument("--plot", default=None, help="measure `report --plot FILE` instead")
    a = ap.parse_args()
    if a.cmd == "make":
        t = time.perf_counter()
        c = make(a.dir, days=a.days, ranks=a.ranks, save_every=a.save_every, keep=a.keep, mtbf_h=a.mtbf_h, ram=a.ram)
        print(json.dumps({**c, "mb": round(c["bytes"] / 1e6, 1), "make_s": round(time.perf_counter() - t, 1)}))
        return
    for d in a.dirs:
        runs = ([], ["--json"]) if a.json else ([],)
        for extra in [["--plot", a.plot]] if a.plot else runs:
            res = measure(d, *extra)
            size = os.path.getsize(os.path.join(d, EVENTS_FILE))
            print(f"{d} {' '.join(extra)}: {size / 1e6:.1f} MB, rc {res['rc']}, wall {res['wall_s']:.2f} s, "
                  f"cpu {res['cpu_s']:.2f} s, peak RSS {res['peak_rss_mb']:.0f} MB {res['stderr'].strip()}")


if __name__ == "__main__":
    main()
