"""Peak host memory of loads and imports, measured as the kernel's peak RSS (VmHWM, reset first)
of the process doing the work (tracemalloc does not see tensor memory)."""

from __future__ import annotations

import math
import os
from typing import Any

from dist_helper import run_ranks


def _peak_rss_extra(fn: Any) -> int:
    """Peak RSS growth during ``fn()``: VmHWM reset to the current RSS first (``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")
    with open("/proc/self/statm", "rb") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    fn()
    with open("/proc/self/status", "rb") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmHWM:"))
    return hwm - base


def _mlp(layers: int = 4, width: int = 2048, fsdp: bool = True) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            fully_shard(layer)
        fully_shard(m)
    return m


def _fsdp_load(rank: int, world: int, path: str) -> tuple[int, int, list[float]]:
    import torch

    import trainguard as tg

    m = _mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)  # fresh: no exp_avg / exp_avg_sq yet
    adam = 2 * sum(p.to_local().numel() * p.element_size() for p in m.parameters())
    extra = _peak_rss_extra(lambda: tg.load(path, {"model": m, "optim": opt}))
    return adam, extra, [opt.state[p]["exp_avg_sq"].to_local().double().sum().item() for p in m.parameters()]


def test_first_fsdp2_load_into_a_fresh_adam_peaks_near_its_state(tmp_path) -> None:
    """2 gloo ranks, FSDP2 MLP (4 x 2048x2048 fp32: Adam state 64 MiB per rank), loaded into a
    fresh Adam on each rank (saved from one process, unsharded). Creating the state to read the shards into was one ``step()``
    with a zero gradient of every parameter: the gradients and foreach Adam's temporaries next
    to the new state made a peak of 1.9-2.1x the state; now ~1.1x (state plus one batch)."""
    import torch

    import trainguard as tg

    m = _mlp(fsdp=False)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, 2048)).square().sum().backward()
    opt.step()
    path = str(tmp_path / "c")
    tg.save(path, {"model": m, "optim": opt})  # one process; the ranks reshard it on load
    for r in run_ranks(_fsdp_load, 2, path, timeout=120):
        adam, extra, sums = r.value
        rows = slice(r.rank * 1024, (r.rank + 1) * 1024)  # FSDP2 shards dim 0
        want = [opt.state[p]["exp_avg_sq"][rows].double().sum().item() for p in m.parameters()]
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(sums, want, strict=True)), (sums, want)
        assert extra < 1.5 * adam, f"rank {r.rank}: peak extra RSS {extra >> 20} MiB for {adam >> 20} MiB of Adam state"
