"""The fixed cost of a save and of a resume for a small state saved often (one process):
``python -m bench.fixed_cost [--dir D] [--saves 30] [--kept 500]``.

Prints, for a ~20 MB model (20 x Linear(512, 512)) + Adam (121 tensors, 63 MB) and for a tiny one
(33 x Linear(16, 16) + Adam, ~200 tensors, 150 KB): ``torch.save`` + fsync + rename + directory fsync
against ``tg.save``, ``torch.load`` against ``tg.load``, a sync ``CheckpointManager.save`` with
``KeepLatest(3)``, a resume (open + restore + close) of a run directory holding 50 steps, and a save
with ``KeepAll`` after ``--kept`` checkpoints, with the ``os.stat`` calls it makes (retention's
manifest lookups: constant since session 46, one per kept checkpoint before). Medians and minimums
in ms; the machine's load shows in the spread. Syscall counts: run a mode under ``strace -f -c``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import trainguard as tg


def _state(width: int, layers: int) -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": m, "optim": opt, "progress": tg.StateDict(step=0)}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(n: int, fn: Callable[[int], Any]) -> str:
    ts = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        ts.append((time.perf_counter() - t) * 1e3)
    ts = ts[1:] or ts  # the first call warms up
    return f"median {statistics.median(ts):7.2f} ms  min {min(ts):7.2f} ms"


def _one_size(label: str, st: dict[str, Any], d: str, n: int) -> None:
    m, opt = st["model"], st["optim"]

    def torch_save(i: int) -> None:
        p = os.path.join(d, f"t-{i}.pt")
        with open(p + ".tmp", "wb") as f:
            torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(p + ".tmp", p)
        _fsync_dir(d)

    def torch_load(i: int) -> None:
        s = torch.load(os.path.join(d, "t-0.pt"), weights_only=True)
        m.load_state_dict(s["model"])
        opt.load_state_dict(s["optim"])

    print(f"[{label}]")
    print(f"  torch.save+fsync   {_timed(n, torch_save)}")
    print(f"  tg.save            {_timed(n, lambda i: tg.save(os.path.join(d, f'g-{i}'), st))}")
    print(f"  torch.load         {_timed(n, torch_load)}")
    print(f"  tg.load            {_timed(n, lambda i: tg.load(os.path.join(d, 'g-0'), st))}")
    root = os.path.join(d, "run")
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), handle_signals=False) as mgr:
        print(f"  manager save (KeepLatest(3)) {_timed(n, lambda i: mgr.save(i + 1, st))}")
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        for i in range(n + 1, 51):
            mgr.save(i, st)

    def resume(i: int) -> None:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
            assert mgr.restore(st) == 50

    print(f"  resume, 50 steps   {_timed(min(n, 10), resume)}")


def _kept(d: str, kept: int) -> None:
    st = {"w": torch.zeros(1000), "progress": tg.StateDict(step=0)}
    real, count = os.stat, [0]

    def stat(*a: Any, **kw: Any) -> Any:
        count[0] += 1
        return real(*a, **kw)

    with tg.CheckpointManager(os.path.join(d, "kept"), save=tg.EveryNSteps(1), keep=tg.KeepAll(),
                              handle_signals=False) as mgr:
        for i in range(1, kept + 1):
            mgr.save(i, st)
        os.stat = stat
        try:
            line = _timed(20, lambda i: mgr.save(kept + 1 + i, st))
        finally:
            os.stat = real
    print(f"[KeepAll, {kept} kept, 1,000 floats] save {line}  os.stat calls a save {count[0] / 20:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fixed_cost", description=__doc__)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed)")
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--kept", type=int, default=500)
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="tg-fixed-", dir=a.dir)
    try:
        for label, (width, layers) in (("20 MB model + Adam", (512, 20)), ("150 KB model + Adam", (16, 33))):
            sub = os.path.join(d, str(width))
            os.makedirs(sub)
            _one_size(label, _state(width, layers), sub, a.saves)
        _kept(d, a.kept)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
