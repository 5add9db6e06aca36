"""c10d store traffic of trainguard's collectives as the world grows: ``python -m bench.store_traffic
[--worlds 2,4,8,16] [--saves 50] [--idle 4] [SRC]`` (SRC: a trainguard ``src`` directory to measure,
e.g. an older commit's worktree; default this checkout's).

Each rank is a subprocess (gloo on 127.0.0.1, ``env://``: rank 0's process hosts the TCPStore), its
state one small tensor. Before trainguard's first call each rank wraps the group's store (the one
``DistContext.current`` takes from ``distributed_c10d._get_default_store``) in a counting proxy: every
call and its bytes (keys and values sent, values received), split into the heartbeat thread's and the
rest. Phases, each between two ``dist.barrier()`` (gloo, not the store; rank 0 first drains its
background deletes into the phase that queued them): a sync ``tg.save``, an async ``tg.save``
(``result()``), a ``tg.load``, ``--saves`` ``CheckpointManager.save`` calls that each save
(``EveryNSteps(1)``, ``KeepLatest(2)``; per save), the manager's ``close()``, ``--idle`` seconds of
nothing (heartbeats per second), and a sync ``tg.save`` that rank 0 enters ``--idle`` seconds late (the
other ranks' polls per second while they wait for it, heartbeats aside). Rank 0 also reports the store's ``num_keys()`` after each phase.
Prints one table row per world size and phase: ops and bytes per non-zero rank, rank 0's, and the total.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_SIZE = {"get": 1, "multi_get": 1}


class CountingStore:
    """A proxy for a c10d store counting each call (and bytes) per thread kind: "hb" or "other"."""

    def __init__(self, raw: object) -> None:
        self._raw = raw
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, list[int]]] = {"hb": {}, "other": {}}

    def snapshot(self) -> dict[str, dict[str, list[int]]]:
        with self.lock:
            return {k: {m: list(v) for m, v in d.items()} for k, d in self.counts.items()}

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._raw, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            out = attr(*args, **kwargs)
            sent = sum(_nbytes(a) for a in args)
            got = _nbytes(out) if name in ("get", "multi_get", "compare_set") else 0
            kind = "hb" if threading.current_thread().name == "trainguard-heartbeat" else "other"
            with self.lock:
                c = self.counts[kind].setdefault(name, [0, 0, 0])
                c[0] += 1
                c[1] += sent
                c[2] += got
            return out

        return call


def _nbytes(v: object) -> int:
    if isinstance(v, (bytes, bytearray, str)):
        return len(v)
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 8 if isinstance(v, int) else 0


def _diff(a: dict, b: dict) -> dict:
    out: dict[str, dict[str, list[int]]] = {}
    for kind in b:
        for m, v in b[kind].items():
            w = a.get(kind, {}).get(m, [0, 0, 0])
            d = [x - y for x, y in zip(v, w, strict=True)]
            if d[0]:
                out.setdefault(kind, {})[m] = d
    return out


def _rank(rank: int, world: int, port: str, root: str, out: str, saves: int, idle: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TRAINGUARD_TIMEOUT="120")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=120))
    proxy = CountingStore(c10d._get_default_store())
    c10d._get_default_store = lambda: proxy  # what DistContext.current takes
    import trainguard as tg
    from trainguard.dist import DistContext

    state = {"w": torch.arange(world * 4, dtype=torch.float32), "step": 0}
    phases: list[dict] = []

    def phase(name: str, fn, per: int = 1) -> None:
        dist.barrier()
        before, t0 = proxy.snapshot(), time.perf_counter()
        fn()
        ctx = DistContext.current()
        if rank == 0 and getattr(ctx, "store", None) is not None:
            for ch in (ctx, *getattr(ctx, "_channels", {}).values()):
                if hasattr(ch, "store"):
                    ch.store.drain()  # rank 0's background deletes, counted in this phase
        dist.barrier()
        secs = time.perf_counter() - t0
        keys = proxy._raw.num_keys() if rank == 0 else None
        phases.append({"phase": name, "per": per, "secs": secs, "ops": _diff(before, proxy.snapshot()), "num_keys": keys})

    phase("sync save", lambda: tg.save(f"{root}/a/step-1", state))
    phase("async save", lambda: tg.save(f"{root}/a/step-2", state, async_=True).result())
    phase("load", lambda: tg.load(f"{root}/a/step-1", state))
    mgr = tg.CheckpointManager(f"{root}/run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), timeout=120)
    phase("manager open+restore", lambda: (mgr.open(), mgr.restore(state)))

    def many() -> None:
        for s in range(1, saves + 1):
            mgr.save(s, state)
        mgr.wait()

    phase("manager save", many, per=saves)
    phase("manager close", mgr.close)
    phase("idle (per s)", lambda: time.sleep(idle), per=1)
    phases[-1]["per"] = phases[-1]["secs"]
    phase("save, rank 0 late (per s)", lambda: (rank == 0 and time.sleep(idle), tg.save(f"{root}/a/step-9", state)))
    phases[-1]["per"] = phases[-1]["secs"]
    Path(out).write_text(json.dumps(phases))
    dist.destroy_process_group()


def _run(world: int, src: str, saves: int, idle: float) -> list[list[dict]]:
    import random
    import socket

    for _ in range(50):
        port = random.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(Path(__file__).resolve().parent.parent)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", "import sys; from bench.store_traffic import _rank; a = sys.argv[1:]; "
           "_rank(int(a[0]), int(a[1]), a[2], a[3], a[4], int(a[5]), float(a[6]))"]
    with tempfile.TemporaryDirectory() as root:
        outs = [f"{root}/out-{r}.json" for r in range(world)]
        procs = [subprocess.Popen([*cmd, str(r), str(world), str(port), root, outs[r], str(saves), str(idle)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
        deadline, logs = time.monotonic() + 300 + saves * world * 0.5, []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if any(not os.path.exists(o) for o in outs):
            raise SystemExit(f"world {world}: a rank failed:\n" + "\n".join(log[-2000:] for log in logs))
        return [json.loads(Path(o).read_text()) for o in outs]


def _sum(ops: dict, kinds: tuple[str, ...]) -> tuple[float, float]:
    n = b = 0
    for k in kinds:
        for v in ops.get(k, {}).values():
            n, b = n + v[0], b + v[1] + v[2]
    return n, b


def table(results: dict[int, list[list[dict]]]) -> list[str]:
    rows = ["| world | phase | ops, rank 0 | ops, other rank (mean) | ops, all ranks | bytes, rank 0 | bytes, other rank (mean) | "
            "bytes, all ranks | store keys after |", "|---|---|---|---|---|---|---|---|---|"]
    for world, ranks in sorted(results.items()):
        for i, ph in enumerate(ranks[0]):
            kinds = ("hb",) if ph["phase"].startswith("idle") else ("other",)
            per = [(_sum(r[i]["ops"], kinds), r[i]["per"]) for r in ranks]
            n = [c[0] / p for c, p in per]
            b = [c[1] / p for c, p in per]
            rest = max(1, world - 1)
            rows.append(f"| {world} | {ph['phase']} | {n[0]:.1f} | {sum(n[1:]) / rest:.1f} | {sum(n):.1f} | {b[0]:,.0f} | "
                        f"{sum(b[1:]) / rest:,.0f} | {sum(b):,.0f} | {ph['num_keys']} |")
    return rows


def methods(results: dict[int, list[list[dict]]]) -> list[str]:
    """Per world and phase: rank 0's and rank 1's calls by method (count per save / per second)."""
    out = []
    for world, ranks in sorted(results.items()):
        for i, ph in enumerate(ranks[0]):
            for r in (0, 1):
                p = ranks[r][i]
                ms = ", ".join(f"{k}:{m}={v[0] / p['per']:.1f}" for k, d in sorted(p["ops"].items()) for m, v in sorted(d.items()))
                out.append(f"world {world} {ph['phase']} rank {r}: {ms}")
    return out


def main(argv: list[str] | None = None) -> dict[int, list[list[dict]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="?", default=str(Path(__file__).resolve().parent.parent / "src"))
    ap.add_argument("--worlds", default="2,4,8,16")
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--idle", type=float, default=4.0)
    ap.add_argument("--methods", action="store_true", help="also print each phase's calls by store method")
    a = ap.parse_args(argv)
    results = {w: _run(w, a.src, a.saves, a.idle) for w in (int(x) for x in a.worlds.split(","))}
    print(f"{a.src}:")
    print("\n".join(table(results)))
    if a.methods:
        print("\n".join(methods(results)))
    return results


if __name__ == "__main__":
    main()
