"""Saves with direct I/O vs buffered, A/B in one process:
``python -m bench.direct_ab [--gb 3] [--rounds 4] [--async]``.

The same state is saved alternately with ``TRAINGUARD_DIRECT_IO=1`` and ``=0``: 400 fp32
tensors (sync), or with ``--async`` an MLP + Adam of about ``--gb`` (``tg.save(async_=True)``
then ``result()``, staged through the pool). Each save's wall time, this process's CPU time
(all its threads) and the CPU time of the whole machine during it (from /proc/stat: all
cores, kernel writeback included) are printed, then the medians of every round but the first.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float, float]]]:
    p = argparse.ArgumentParser(prog="python -m bench.direct_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--async", dest="async_", action="store_true", help="async saves of a model + Adam")
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp" / "direct_ab")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    state: dict = {}
    if a.async_:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(max(1, round(a.gb * 1e9 / 12.6e6)))])
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        state = {"model": model, "optim": opt}
    else:
        n = int(a.gb * 1e9 / 4 / 400)
        state = {f"t{i}": torch.randn(n) for i in range(400)}
    shutil.rmtree(a.tmp, ignore_errors=True)
    a.tmp.mkdir(parents=True)
    res: dict[str, list[tuple[float, float, float]]] = {"direct": [], "buffered": []}
    old = os.environ.get("TRAINGUARD_DIRECT_IO")
    try:
        for rep in range(a.rounds):
            for mode in res:
                os.environ["TRAINGUARD_DIRECT_IO"] = "1" if mode == "direct" else "0"
                path = a.tmp / f"{mode}{rep}"
                c0, p0, t0 = machine_cpu_s(), process_cpu_s(), time.perf_counter()
                if a.async_:
                    tg.save(path, state, async_=True).result()
                else:
                    tg.save(path, state)
                res[mode].append((time.perf_counter() - t0, process_cpu_s() - p0, machine_cpu_s() - c0))
                w, pc, mc = res[mode][-1]
                print(f"{mode:<9} round {rep}: {w:.2f} s, process CPU {pc:.2f} s, machine CPU {mc:.2f} s", flush=True)
                shutil.rmtree(path)
    finally:
        if old is None:
            os.environ.pop("TRAINGUARD_DIRECT_IO", None)
        else:
            os.environ["TRAINGUARD_DIRECT_IO"] = old
        shutil.rmtree(a.tmp, ignore_errors=True)
    for mode, v in res.items():
        steady = v[1:] or v
        med = [statistics.median(x[i] for x in steady) for i in range(3)]
        print(f"{mode:<9} median {med[0]:.2f} s, process CPU {med[1]:.2f} s, machine CPU {med[2]:.2f} s")
    return res


if __name__ == "__main__":
    main()
