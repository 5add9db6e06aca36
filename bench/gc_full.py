"""Full collections of Python's cyclic GC caused by async saves, with and without the hold.

``python -m bench.gc_full [--saves 60] [--layers 79] [--width 512] [--out F] [--tmp DIR]``

An async save builds tracked objects per tensor (leaves, byte views, write records, manifest
entries) that live through its write; with the collector running, young collections promote
them to the oldest generation, and CPython runs a *full* collection (the whole heap: 100-200 ms
in a process that imported torch) each time that generation grew by a quarter. trainguard holds
the collector paused from the save's call until its thread ends (``gcpause.hold``). This runs
the same loop (2 small training steps, then an async save of ``layers`` x ``Linear(width,
width)`` + Adam: 8 tensors a layer, weight, bias, their moments and steps) twice in one process: the hold as shipped, then with
``gcpause.ASYNC_HOLD_S = 0`` (the hold ends at the first optimizer step after the call, so the
collector runs during the write, as before the hold existed), and once with no saves. Counts the
full collections (``gc.callbacks``) and their time. Prints a table and writes a JSON file.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import trainguard as tg
from trainguard import gcpause

REPO = Path(__file__).resolve().parent.parent


def run(saves: int, layers: int, width: int, save: bool, where: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(2, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    full: list[float] = []
    t0 = [0.0]

    def seen(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                t0[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - t0[0])

    where.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=where))
    calls: list[float] = []
    h = None
    gc.collect()
    gc.callbacks.append(seen)
    try:
        for i in range(saves):
            step()
            step()
            if not save:
                continue
            if h is not None:
                h.result()
            c0 = time.perf_counter()
            h = tg.save(tmp / f"s{i}", {"model": model, "optim": opt}, async_=True)
            calls.append(time.perf_counter() - c0)
            if i >= 2:
                shutil.rmtree(tmp / f"s{i - 2}", ignore_errors=True)
        if h is not None:
            h.result()
    finally:
        gc.callbacks.remove(seen)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "saves": saves if save else 0, "tensors": 8 * layers, "full_collections": len(full),
        "full_s_total": sum(full), "full_s_median": statistics.median(full) if full else 0.0,
        "call_median_s": statistics.median(calls) if calls else 0.0, "tracked_objects": len(gc.get_objects()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=60)
    p.add_argument("--layers", type=int, default=79)  # 632 tensors, as bench.stall's 1 GB model
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gc_full.json"))
    p.add_argument("--tmp", default=str(REPO / "bench"), help="where the checkpoints go (removed after)")
    a = p.parse_args(argv)
    arms: dict[str, Any] = {}
    shipped = gcpause.ASYNC_HOLD_S
    for name, hold_s, save in (("hold", shipped, True), ("no hold", 0.0, True), ("no saves", shipped, False)):
        gcpause.ASYNC_HOLD_S = hold_s
        try:
            arms[name] = run(a.saves, a.layers, a.width, save, Path(a.tmp))
        finally:
            gcpause.ASYNC_HOLD_S = shipped
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "args": vars(a), "arms": arms}
    print(f"{a.saves} rounds of 2 steps + an async save, {8 * a.layers} tensors\n")
    print("| arm | full collections | their time (s) | median each (s) | call median (s) |")
    print("|---|---|---|---|---|")
    for name, r in arms.items():
        print(f"| {name} | {r['full_collections']} | {r['full_s_total']:.3f} | {r['full_s_median']:.3f} | {r['call_median_s']:.4f} |")
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
