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


def _anon() -> int:
    with open("/proc/self/status", "rb") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(b"RssAnon:"))


def test_torch_save_import_does_not_copy_the_file_into_memory(tmp_path, monkeypatch) -> None:
    """``convert`` of a ``torch.save`` file (here 64 MiB, a Hugging Face ``.bin`` shard is one
    too) read it with ``torch.load`` into anonymous memory and held the copy until its save had
    written everything: 64 MiB more anonymous memory while the writes ran. Now memory-mapped,
    as safetensors' ``load_file`` already was: the save writes from the file's pages (clean page
    cache, which VmHWM counts but the kernel can drop; RssAnon does not count it). Sampled at
    every checksum of the written data, i.e. while every imported tensor is alive."""
    import torch

    import trainguard as tg
    import trainguard.io as tio
    from trainguard.convert import convert

    src = tmp_path / "pytorch_model.bin"
    ref = {f"layer{i}.weight": torch.randn(1024, 2048) for i in range(8)}  # 8 x 8 MiB
    torch.save(ref, src)
    size = src.stat().st_size
    del ref
    peak = [0]
    checksum = tio.checksum

    def sampled(view: Any) -> Any:
        peak[0] = max(peak[0], _anon())
        return checksum(view)

    monkeypatch.setattr(tio, "checksum", sampled)
    base = _anon()
    convert(src, tmp_path / "c")
    monkeypatch.undo()
    assert peak[0], "the save wrote nothing?"
    extra = peak[0] - base
    assert extra < size // 4, f"{extra >> 20} MiB more anonymous memory while importing a {size >> 20} MiB file"
    back = {k: torch.empty(1024, 2048) for k in torch.load(src, weights_only=True, mmap=True)}
    tg.load(tmp_path / "c", {"model": back})
    want = torch.load(src, weights_only=True, mmap=True)
    assert all(torch.equal(back[k], want[k]) for k in want)
