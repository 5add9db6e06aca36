"""Profile-guided pass on trainguard's hot paths (issue 6):
``python -m bench.profile [--state gpt] [--rounds 4] [--ops save,hot,cold] [--cprofile OP]``.

Builds one bench state (default ``gpt``: 3.1 GB GPT + AdamW), then per round: a durable
``tg.save``, a hot ``tg.load`` in place (files read once before), a cold one (caches dropped
as in ``bench.run``). Prints each operation's wall time, this process's CPU time and the
medians of every round but the first. ``--cprofile save`` (or hot, cold) runs that operation
of the last round under cProfile and prints its top functions (the caller's thread only: the
I/O threads show as waits). For every thread at once use py-spy from outside:
``py-spy record -r 250 -o prof.svg -- python -m bench.profile --ops hot --rounds 8``.
"""

from __future__ import annotations

import argparse
import cProfile
import io as _io
import pstats
import shutil
import statistics
import time
from pathlib import Path

import torch

import trainguard as tg

from .direct_ab import process_cpu_s
from .measure import CacheDropper, fsync_tree, prewarm, release_free_memory
from .states import build_state, mark

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default="gpt", choices=["100mb", "gpt", "small10k"])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--n-small", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", default="save,hot,cold")
    p.add_argument("--cprofile", default="", help="an op (save, hot, cold) to profile in the last round")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sort", default="tottime", help="pstats sort key: tottime, cumulative")
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp" / "profile")
    a = p.parse_args(argv)
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    state = build_state(a.state, a.scale, a.n_small, 0)
    dropper = CacheDropper("auto")
    shutil.rmtree(a.tmp, ignore_errors=True)
    a.tmp.mkdir(parents=True)
    path = a.tmp / "step"
    res: dict[str, list[tuple[float, float]]] = {o: [] for o in ops}
    try:
        for rnd in range(a.rounds):
            for op in ["save", *[o for o in ops if o != "save"]] if rnd == 0 or "save" in ops else ops:
                if op != "save":
                    mark(state, -1.0)  # the load must overwrite this
                    (prewarm if op == "hot" else dropper.drop)(path)
                elif path.exists():
                    shutil.rmtree(path)
                release_free_memory()
                prof = cProfile.Profile() if (op == a.cprofile and rnd == a.rounds - 1) else None
                c0, t0 = process_cpu_s(), time.perf_counter()
                if prof:
                    prof.enable()
                if op == "save":
                    mark(state, float(rnd))
                    tg.save(str(path), state)
                    fsync_tree(path)
                else:
                    tg.load(str(path), state)
                if prof:
                    prof.disable()
                wall, cpu = time.perf_counter() - t0, process_cpu_s() - c0
                if op != "save":
                    assert float(state[next(iter(state))].reshape(-1)[0]) != -1.0, "load did not overwrite"
                if op in res:
                    res[op].append((wall, cpu))
                    print(f"round {rnd} {op:<5} {wall:.3f} s  CPU {cpu:.2f} s", flush=True)
                if prof:
                    s = _io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats(a.sort).print_stats(a.top)
                    print(s.getvalue())
    finally:
        shutil.rmtree(a.tmp, ignore_errors=True)
    for op, v in res.items():
        steady = v[1:] or v
        print(f"{op:<5} median {statistics.median(x[0] for x in steady):.3f} s "
              f"[{min(x[0] for x in steady):.3f}-{max(x[0] for x in steady):.3f}], "
              f"CPU {statistics.median(x[1] for x in steady):.2f} s")
    return res


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
