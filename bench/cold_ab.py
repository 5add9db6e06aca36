"""Cold loads with and without the extra O_DIRECT read thread, A/B in one process:
``python -m bench.cold_ab [--state gpt|small10k] [--rounds 6] [--scale 1.0]``.

The state (``bench.states``) is saved once under a temporary directory; then each round loads
it into existing tensors twice, with ``trainguard.io.COLD_DIRECT_EXTRA`` = 1 and = 0 in turn,
after dropping the page cache (``drop_caches`` as root, else ``posix_fadvise``). Prints each
load's wall time, then min, median and max per variant, and checks the loaded bytes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import trainguard as tg
from trainguard import io as tio

from .measure import CacheDropper
from .states import build_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_ab", description=__doc__)
    ap.add_argument("--state", default="gpt", choices=("gpt", "small10k", "100mb"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    state = build_state(a.state, a.scale, 10_000, 0)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}  # touched once, before timing
    cold = CacheDropper("auto")
    print(f"{a.state}: {sum(t.nbytes for t in state.values()) / 1e9:.2f} GB; {cold.describe()}")
    times: dict[int, list[float]] = {1: [], 0: []}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        ck = Path(tmp) / "ck"
        tg.save(ck, state)
        try:
            for r in range(a.rounds):
                for extra in (1, 0):
                    tio.COLD_DIRECT_EXTRA = extra
                    cold.drop(ck)
                    t = time.perf_counter()
                    tg.load(ck, dest)
                    times[extra].append(time.perf_counter() - t)
                    print(f"round {r} extra={extra}: {times[extra][-1]:.3f} s", flush=True)
        finally:
            tio.COLD_DIRECT_EXTRA = 1
    return report("extra", times, state, dest)


def report(name: str, times: dict, state: dict[str, torch.Tensor], dest: dict[str, torch.Tensor]) -> int:
    """Print min, median and max per variant of an A/B; 1 if ``dest`` does not hold ``state``."""
    for value, v in times.items():
        print(f"{name}={value}: min {min(v):.3f}  median {statistics.median(v):.3f}  max {max(v):.3f} s")
    bad = [k for k in state if not torch.equal(state[k], dest[k])]
    if bad:
        print(f"MISMATCH in {len(bad)} tensors, e.g. {bad[0]}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
