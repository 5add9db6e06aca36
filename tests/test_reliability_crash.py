"""Crash consistency, exhaustively: a save is killed with SIGKILL at every named fault point and
at random byte counts inside the data writes (a partial write, then SIGKILL), on 1 rank and on
2 ranks, sync and async. After each kill: ``restore`` returns exactly the last committed step, the
state it loads equals that step's state bit for bit, ``verify`` passes on every directory ``ls``
reports valid, and the next manager start removes the debris.

One-rank trials run in processes forked by a small trial server that imported torch once (a
trial costs a fork and a few MB of I/O, not a Python start). Each test prints
``trials=N failures=M``.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.faults import POINTS
from trainguard.inspect import list_checkpoints
from trainguard.storage import LocalStorage

from conftest import ROOT, TESTS
from dist_helper import run_ranks

RANDOM_TRIALS = int(os.environ.get("TG_CRASH_TRIALS", "50"))  # half sync, half async
COMMITTED_AFTER = {"after_rename", "before_retention"}


def state_for(step: int) -> dict:
    """~3.5 MB: three 1.1 MB tensors (one write each) and small ones (coalesced writes)."""
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "model": model,
        "data": {
            "big": [torch.randn(280_000, generator=g) for _ in range(3)],
            "small": [torch.randn(1000 + i, generator=g) for i in range(20)],
        },
        "progress": tg.StateDict(step=step),
    }


def same(a: dict, b: dict) -> bool:
    pairs = [(a["model"].weight, b["model"].weight), (a["model"].bias, b["model"].bias)]
    pairs += list(zip(a["data"]["big"], b["data"]["big"])) + list(zip(a["data"]["small"], b["data"]["small"]))
    return a["progress"]["step"] == b["progress"]["step"] and all(torch.equal(x, y) for x, y in pairs)


def _kill_after_bytes(limit: int) -> None:
    """Make this process SIGKILL itself once ``limit`` data bytes were written (mid-write: the
    piece that crosses the limit is written only up to it)."""
    from trainguard.storage import local

    lock = threading.Lock()
    written = [0]
    orig = local._LocalWriter.pwrite

    def pwrite(self, data: memoryview, offset: int) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        with lock:
            room = limit - written[0]
            if room < len(view):
                if room > 0:
                    orig(self, view[:room], offset)
                os.kill(os.getpid(), signal.SIGKILL)
            written[0] += len(view)
        orig(self, view, offset)

    local._LocalWriter.pwrite = pwrite


def _trial(root: str, mode: str, kill_at_byte: int | None, point: str | None) -> None:
    """One trial, in a forked child: save step 2 over a run directory holding step 1."""
    if kill_at_byte is not None:
        _kill_after_bytes(kill_at_byte)
    if point is not None:
        os.environ.update(TRAINGUARD_CRASH_AT=point, TRAINGUARD_CRASH_KIND="kill")
    torch.set_num_threads(1)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=mode == "async",
                              handle_signals=False) as mgr:
        mgr.save(2, state_for(2))
        mgr.wait()


SERVER = r"""
import json, os, sys, tempfile, traceback
import torch
import test_reliability_crash as t
import trainguard as tg
# Warm up once (lazy imports such as torch.distributed.tensor cost ~0.7 s): a sync save and a
# load in a temp directory. No thread is left running, so forking afterwards is safe.
torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as d:
    tg.save(d + "/step-000000001", t.state_for(0))
    tg.load(d + "/step-000000001", t.state_for(1))
    import trainguard.async_save, trainguard.stage  # noqa: F401
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            t._trial(*json.loads(line))
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class TrialServer:
    """A child Python that imported torch and trainguard once and forks one process per trial
    (it runs no torch code itself, so forking it is safe). Killed by PID on timeout or close."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)

    def run(self, args: list, timeout: float = 120) -> int | None:
        """Run one trial; its exit code (-9: killed by SIGKILL), or None if it hung (then the server is killed)."""
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            return None
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by PID; a trial child left running would be orphaned, but each ends by SIGKILL
        self.proc.wait(10)


def _data_bytes(ckpt: Path) -> dict[str, int]:
    """Data bytes written per file (chunk lengths, not holes) by the save of ``ckpt``."""
    m = read_manifest(LocalStorage(), str(ckpt))
    out: dict[str, int] = {}
    for e in m.tensors.values():
        for c in e.chunks:
            out[c.file] = out.get(c.file, 0) + c.length
    return out


def check_after_crash(root: Path, expect: int) -> list[str]:
    """Everything the issue asks of the directory a killed save left. Returns the problems."""
    problems = []
    rows = list_checkpoints(root)
    valid = [r.step for r in rows if r.status == "valid"]
    if not valid or valid[-1] != expect:
        problems.append(f"ls: newest valid {valid}, expected {expect}")
    for r in rows:
        if r.status == "valid" and not tg.verify(r.path).ok:
            problems.append(f"verify failed on {r.name}, which ls reports valid")
    state = state_for(99)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        left = [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n]
        if left or any(r.status != "valid" for r in list_checkpoints(root)):
            problems.append(f"debris left after the next start: {left}")
        got = mgr.restore(state)
    if got != expect:
        problems.append(f"restore returned {got}, expected {expect}")
    elif not same(state, state_for(expect)):
        problems.append(f"restored state differs from step {expect}'s")
    return problems


def test_sigkill_at_named_points_and_random_write_moments(tmp_path):
    template = tmp_path / "template"
    with tg.CheckpointManager(template, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
    total = sum(_data_bytes(template / "step-000000001").values())
    rng = random.Random(7)
    plan = [(mode, None, p) for mode in ("sync", "async") for p in POINTS]
    plan += [(("sync", "async")[i % 2], rng.randrange(total), None) for i in range(RANDOM_TRIALS)]
    server = TrialServer()
    trials = failures = debris_seen = 0
    report = []
    t_child = t_check = 0.0
    for i, (mode, at_byte, point) in enumerate(plan):
        root = tmp_path / f"t{i}"
        shutil.copytree(template, root)
        t0 = time.monotonic()
        code = server.run([str(root), mode, at_byte, point])
        t1 = time.monotonic()
        trials += 1
        what = f"{mode} " + (f"point={point}" if point else f"byte={at_byte}/{total}")
        problems = [] if code == -signal.SIGKILL else [f"child exit code {code}, not SIGKILL"]
        debris_seen += any(".tmp-" in n for n in os.listdir(root))
        expect = 2 if point in COMMITTED_AFTER else 1
        problems += check_after_crash(root, expect)
        t_child, t_check = t_child + t1 - t0, t_check + time.monotonic() - t1
        if problems:
            failures += 1
            report.append(f"{what}: {problems}")
        shutil.rmtree(root)
    server.close()
    print(f"crash 1-rank: trials={trials} failures={failures} (named={2 * len(POINTS)}, "
          f"random={RANDOM_TRIALS}, runs that left debris={debris_seen}; seconds in children {t_child:.1f}, "
          f"in checks {t_check:.1f})")
    assert failures == 0, "\n".join(report)
    assert trials == 2 * len(POINTS) + RANDOM_TRIALS and debris_seen >= RANDOM_TRIALS // 2


# ----------------------------------------------------------------------------- 2 ranks


def two_rank_trial(rank: int, world: int, root: str, mode: str, kill_bytes: list[int] | None) -> str | None:
    """Each rank saves step 1, then step 2 with a kill armed (bytes per rank, or the env's point)."""
    torch.set_num_threads(1)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=mode == "async",
                               handle_signals=False, timeout=60).open()
    mgr.save(1, state_for(1))
    mgr.wait()
    if kill_bytes is not None:
        _kill_after_bytes(kill_bytes[rank])
    else:
        os.environ["TRAINGUARD_CRASH_AT"] = os.environ["ARM_CRASH_AT"]
    try:
        mgr.save(2, state_for(2))
        mgr.wait()
    except tg.CheckpointError as e:  # a survivor learns of the dead rank
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def test_sigkill_on_two_ranks(tmp_path):
    """Four spawns of 2 ranks: both ranks killed mid-write (sync, async), and rank 0 killed at
    a commit point while rank 1 survives and reports the failure (sync, async)."""
    rng = random.Random(11)
    sizes = None
    trials = failures = 0
    report = []
    cases = [("sync", "bytes"), ("async", "bytes"), ("sync", "after_manifest"), ("async", "before_manifest")]
    for i, (mode, kind) in enumerate(cases):
        root = tmp_path / f"r{i}"
        if kind == "bytes":
            sizes = sizes or _rank_bytes(2)
            kill = [rng.randrange(sizes[r]) for r in range(2)]
            res = run_ranks(two_rank_trial, 2, str(root), mode, kill, timeout=120, check=False)
            ok = all(r.exitcode == -signal.SIGKILL for r in res)
        else:
            env = {"ARM_CRASH_AT": kind, "TRAINGUARD_CRASH_RANK": "0", "TRAINGUARD_CRASH_KIND": "kill",
                   "TRAINGUARD_DEAD_AFTER": "3"}
            res = run_ranks(two_rank_trial, 2, str(root), mode, None, timeout=120, env=env, check=False)
            ok = res[0].exitcode == -signal.SIGKILL and res[1].ok and "[0]" in (res[1].value or "")
        trials += 1
        problems = [] if ok else [f"ranks: {[(r.exitcode, r.value, (r.error or '')[-300:]) for r in res]}"]
        problems += check_after_crash(root, 1)
        if problems:
            failures += 1
            report.append(f"{mode} {kind}: {problems}")
    print(f"crash 2-rank: trials={trials} failures={failures}")
    assert failures == 0, "\n".join(report)


def _rank_bytes(world: int) -> list[int]:
    """The data bytes each rank writes for ``state_for``: the planner's deterministic split of
    replicated tensors, computed here instead of spawning ranks to find out."""
    from trainguard.api import capture
    from trainguard.dist import DistContext
    from trainguard.planner import ReplicatedItem, assign_replicated

    snap = capture(state_for(1), ctx=DistContext.current())
    items = [ReplicatedItem(lf.path, lf.shape, lf.tensor.element_size()) for lf in snap.leaves]
    out = [0] * world
    for _path, box, r in assign_replicated(items, world, [0] * world):
        out[r] += box.numel * 4  # every tensor here is float32
    return out
