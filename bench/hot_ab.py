"""Hot loads with each checksum block read and hashed in parts vs hashed whole, A/B in one
process: ``python -m bench.hot_ab [--state gpt] [--rounds 8] [--sub 524288]``.

The state (``bench.states``) is saved once under a temporary directory and its files read once
(page cache); then each round loads it into existing tensors twice, with
``_LocalReader.hash_sub`` = ``--sub`` and = None (read a piece, then hash each 4 MiB block).
Prints min, median and max per variant and checks the loaded bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import trainguard as tg
from trainguard.storage.local import HASH_SUB, _LocalReader

from .cold_ab import report
from .states import build_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hot_ab", description=__doc__)
    ap.add_argument("--state", default="gpt", choices=("gpt", "small10k", "100mb"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--sub", type=int, default=HASH_SUB)
    a = ap.parse_args(argv)
    state = build_state(a.state, a.scale, 10_000, 0)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    times: dict[int | None, list[float]] = {a.sub: [], None: []}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        ck = Path(tmp) / "ck"
        tg.save(ck, state)
        for f in ck.iterdir():
            f.read_bytes()  # into the page cache (the save wrote around it)
        tg.load(ck, dest)
        try:
            for _ in range(a.rounds):
                for sub in times:
                    _LocalReader.hash_sub = sub
                    t = time.perf_counter()
                    tg.load(ck, dest)
                    times[sub].append(time.perf_counter() - t)
        finally:
            _LocalReader.hash_sub = HASH_SUB
    return report("hash_sub", times, state, dest)


if __name__ == "__main__":
    raise SystemExit(main())
