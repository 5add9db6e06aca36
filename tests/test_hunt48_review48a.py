"""Session 48 review of the save path (review48a): defects found reading stage/stagecopy/async_save/
io/storage whole, each reproduced with real saves on real files first."""

from __future__ import annotations

import threading

import torch
from torch import nn

import trainguard as tg
from trainguard import async_save
from trainguard.buffers import aligned_empty
from trainguard.stage import default_pool
from trainguard.storage import local


class Two(nn.Module):
    """Two weights: ``a`` (1 MiB) and ``b`` (8 MiB, its memory 64 bytes into a page)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(256, 1024))
        base = aligned_empty((8 << 20) + 4096, 4096)
        self.b = nn.Parameter(base[64 : 64 + (8 << 20)].view(torch.float32).view(2048, 1024).copy_(torch.randn(2048, 1024)))


def test_zero_copy_rest_copied_under_a_one_block_cap_is_staged(tmp_path, monkeypatch):
    """A zero-copy save (``TRAINGUARD_ASYNC_ZERO_COPY=1``) whose ``step()`` comes while batches remain copies
    the rest into the staging buffer, each large chunk at its memory's page phase. Under a cap of one
    checksum block (``max_staging_bytes=4 MiB``) an empty buffer had no room for the phase plus a block:
    ``pack_batches`` handed over empty batches for good (3 million in a minute), ``staged()`` never turned
    true and ``step()`` waited forever. Now such a piece goes without the phase (written buffered)."""
    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "1")
    monkeypatch.setattr(async_save, "ZERO_COPY_BATCH", 1 << 20)  # ``a`` is written live alone, ``b`` remains
    torch.manual_seed(0)
    model = Two()
    assert model.b.data_ptr() % 4096 == 64
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    at_call = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handles: list = []
    known = threading.Event()
    real = local._LocalWriter.pwrite

    def held(self, data, offset):  # the first batch's write waits until someone waits for staged()
        assert known.wait(60) and handles[0].waiting.wait(60)
        return real(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", held)
    h = tg.save(tmp_path / "a", state, async_=True, max_staging_bytes=4 << 20)
    handles.append(h)
    known.set()
    assert h.wait_staged(30), f"never staged ({h.staging_batches} batches handed over)"
    assert h.written_live_bytes == 1 << 20 and h.staged_background_bytes == 8 << 20
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # after staged(): the checkpoint keeps the values at the call
    h.result(timeout=60)
    fresh = Two()
    tg.load(tmp_path / "a", {"model": fresh}, only=["model"])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_call[k]), k
    assert not default_pool(4 << 20).in_use
