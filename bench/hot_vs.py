"""Hot in-place loads of trainguard against safetensors + ``copy_``, paired in one process:
``python -m bench.hot_vs [--state gpt] [--rounds 9]``.

The state (``bench.states``) is saved once with ``tg.save`` and once with safetensors'
``save_file``; then each round loads it into existing tensors three ways, the order rotated by
one each round, every file read just before (``measure.prewarm``: the page cache holds it):

- ``tg``: ``tg.load`` (every byte's checksum verified, as by default);
- ``tg_noverify``: ``tg.load(..., verify=False)``: the same reads without the checksums;
- ``st``: safetensors ``load_file`` (its memory map) and ``copy_`` into the tensors.

Prints min, median and max of each and the ratio tg ÷ st round by round, so that what the
checksum costs is told apart from the rest of the load. Checks the loaded bytes after each load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import trainguard as tg

from .measure import prewarm
from .states import build_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hot_vs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", default="gpt", choices=("gpt", "small10k", "100mb"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    state = build_state(a.state, a.scale, 10_000, 0)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        ck, st = Path(tmp) / "ck", Path(tmp) / "st.safetensors"
        tg.save(ck, state)
        save_file(state, str(st))

        def st_load() -> None:
            loaded = load_file(str(st))
            with torch.no_grad():
                for k, t in dest.items():
                    t.copy_(loaded[k])

        ways: dict[str, Callable[[], object]] = {
            "tg": lambda: tg.load(ck, dest),
            "tg_noverify": lambda: tg.load(ck, dest, verify=False),
            "st": st_load,
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        for k in names:  # a first load of each, not timed
            prewarm(Path(tmp))
            ways[k]()
        for r in range(a.rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                for t in dest.values():
                    t.zero_()
                prewarm(Path(tmp))
                t0 = time.perf_counter()
                ways[k]()
                times[k].append(time.perf_counter() - t0)
                bad = [n for n in state if not torch.equal(state[n], dest[n])]
                if bad:
                    print(f"{k}: MISMATCH in {len(bad)} tensors, e.g. {bad[0]}")
                    return 1
    for k, v in times.items():
        print(f"{k:<12} min {min(v):.3f}  median {statistics.median(v):.3f}  max {max(v):.3f} s")
    ratios = [a / b for a, b in zip(times["tg"], times["st"], strict=True)]
    print(f"tg / st round by round: {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}")
    nv = [a / b for a, b in zip(times["tg_noverify"], times["st"], strict=True)]
    print(f"tg_noverify / st round by round: {[round(x, 2) for x in nv]}, median {statistics.median(nv):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
