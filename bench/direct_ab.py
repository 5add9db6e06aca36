"""Sync save with direct I/O vs buffered, A/B in one process: ``python -m bench.direct_ab [--gb 3] [--rounds 4]``.

The same state (400 fp32 tensors) is saved alternately with ``TRAINGUARD_DIRECT_IO=1`` and
``=0``; each save's wall time and the CPU time of the whole machine during it (from
/proc/stat: all cores, kernel writeback included) are printed, then the medians of every
round but the first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

import trainguard as tg

REPO = Path(__file__).resolve().parent.parent


def machine_cpu_s() -> float:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # busy: all but idle and iowait


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    p = argparse.ArgumentParser(prog="python -m bench.direct_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp" / "direct_ab")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    n = int(a.gb * 1e9 / 4 / 400)
    state = {f"t{i}": torch.randn(n) for i in range(400)}
    shutil.rmtree(a.tmp, ignore_errors=True)
    a.tmp.mkdir(parents=True)
    res: dict[str, list[tuple[float, float]]] = {"direct": [], "buffered": []}
    old = os.environ.get("TRAINGUARD_DIRECT_IO")
    try:
        for rep in range(a.rounds):
            for mode in res:
                os.environ["TRAINGUARD_DIRECT_IO"] = "1" if mode == "direct" else "0"
                path = a.tmp / f"{mode}{rep}"
                c0, t0 = machine_cpu_s(), time.perf_counter()
                tg.save(path, state)
                res[mode].append((time.perf_counter() - t0, machine_cpu_s() - c0))
                print(f"{mode:<9} round {rep}: {res[mode][-1][0]:.2f} s, machine CPU {res[mode][-1][1]:.2f} s", flush=True)
                shutil.rmtree(path)
    finally:
        if old is None:
            os.environ.pop("TRAINGUARD_DIRECT_IO", None)
        else:
            os.environ["TRAINGUARD_DIRECT_IO"] = old
        shutil.rmtree(a.tmp, ignore_errors=True)
    for mode, v in res.items():
        steady = v[1:] or v
        print(f"{mode:<9} median {statistics.median(x[0] for x in steady):.2f} s, "
              f"machine CPU {statistics.median(x[1] for x in steady):.2f} s")
    return res


if __name__ == "__main__":
    main()
