"""Per-byte save rate of 10,000 small tensors against the large-tensor state, paired (issue 6).

``python -m bench.per_byte [--rounds 7] [--scale 1.0] [--n-small 10000] [--out F]``

Issue 6 asks that saving the ``small10k`` state be no more than 1.5x slower per byte than saving
the ``gpt`` state (rate ratio >= 0.67). ``bench.run`` measures each state in its own worker
process, minutes apart, and on this shared VM the same save drifts by a third over such spans
(the small-tensor save took 0.87 s, median of 5, at 09:47 and 1.09-1.15 s at 09:54 on
2026-12-04), so the ratio of its two medians mixes two states with two machines. Here one process
holds both states and saves them back to back (durable ``tg.save``: the call, then fsync of every
file, the directory and its parent, as ``bench.run`` does), the order swapped every round, and
the ratio is taken round by round. Round 0 is reported apart. No raw limit is paired: tried
(2026-12-04 09:58), ``raw_2`` took 2.9-3.2 s for the large state when it ran second in a round
against 1.0-1.3 s when first (cause not looked into), and ``raw_d2`` took 1.4-1.7 s for the small
state, more than trainguard's save; neither gave a stable per-byte figure for the disk.
Prints one line per round and writes a JSON file (default ``bench/results/per_byte.json``).
Needs ~5 GB of RAM and disk at scale 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import trainguard as tg

from .measure import fsync_tree, release_free_memory
from .states import State, build_state, check_marks, mark, state_bytes

REPO = Path(__file__).resolve().parent.parent
TARGET = 1 / 1.5  # issue 6: small tensors no more than 1.5x slower per byte


def _timed(d: Path, state: State, tag: float) -> float:
    """One durable save into a fresh ``d``: seconds from the call until the directory is fsynced."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    release_free_memory(full=True)
    mark(state, tag)
    t0 = time.perf_counter()
    tg.save(str(d), state)
    fsync_tree(d)
    return time.perf_counter() - t0


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.per_byte", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="rounds after the first (default 7)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies both states' sizes")
    p.add_argument("--n-small", type=int, default=10_000)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "per_byte.json")
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp" / "per_byte")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    states = {"large": build_state("gpt", a.scale, a.n_small, 0), "small": build_state("small10k", a.scale, a.n_small, 0)}
    nbytes = {k: state_bytes(v) for k, v in states.items()}
    rounds: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime())
    shutil.rmtree(a.tmp, ignore_errors=True)
    try:
        for rnd in range(a.rounds + 1):
            order = ["large", "small"] if rnd % 2 == 0 else ["small", "large"]
            sec = {k: _timed(a.tmp / k, states[k], float(rnd + 1)) for k in order}
            rate = {k: nbytes[k] / sec[k] / 1e9 for k in sec}
            rounds.append({"round": rnd, "order": order, "seconds": sec, "gbps": rate,
                           "ratio": rate["small"] / rate["large"]})
            print(f"round {rnd}: large {sec['large']:.3f} s ({rate['large']:.2f} GB/s), small {sec['small']:.3f} s "
                  f"({rate['small']:.2f} GB/s), ratio {rate['small'] / rate['large']:.2f}", flush=True)
        for k, st in states.items():  # the last round's checkpoints hold what was saved
            mark(st, -1.0)
            tg.load(str(a.tmp / k), st)
            if (problem := check_marks(st, list(st), float(a.rounds + 1))) is not None:
                raise AssertionError(f"{k}: the checkpoint does not hold the saved values: {problem}")
    finally:
        shutil.rmtree(a.tmp, ignore_errors=True)
    steady = rounds[1:]
    res = {
        "what": "trainguard's durable save: per-byte rate of small10k / gpt, paired round by round in one process",
        "argv": sys.argv[1:] if argv is None else argv, "scale": a.scale, "n_small": a.n_small, "bytes": nbytes,
        "tensors": {k: len(v) for k, v in states.items()}, "target_ratio": TARGET, "started": started,
        "rounds": rounds,
        "first": rounds[0]["ratio"],
        "ratio": _summary([r["ratio"] for r in steady]),
        "seconds": {k: _summary([r["seconds"][k] for r in steady]) for k in states},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    s = res["ratio"]
    print(f"small/large per-byte ratio median {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] over {len(steady)} "
          f"rounds (first {res['first']:.2f}); target >= {TARGET:.2f}: {'met' if s['median'] >= TARGET else 'missed'}")
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
