"""Direct I/O writes (storage.local): whole pages of large chunks go through O_DIRECT straight
from tensor memory (sync) or the staging pool (async), the bytes around them buffered; the
checkpoint loads bit for bit either way, and a kernel that refuses O_DIRECT gets buffered writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import io
from trainguard.planner import layout_file
from trainguard.storage.local import DIRECT_ALIGN, LocalStorage


def odd_state() -> dict[str, torch.Tensor]:
    """Large tensors at every kind of address: fresh (page + 64), a view 4 bytes in (not on
    64 bytes), a view whose length is no multiple of a page, plus small ones between them."""
    torch.manual_seed(0)
    base = torch.randn(3 << 20)
    return {
        "a": torch.randn(1 << 20),
        "s1": torch.randn(7),
        "view4": base[1:],  # storage offset 4 bytes
        "s2": torch.arange(1000, dtype=torch.int16),
        "odd": torch.randn((1 << 20) + 123),
        "b": torch.randn(5 << 20).to(torch.bfloat16),
    }


def fresh(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("direct", ["1", "0"])
def test_sync_save_direct_and_buffered_load_bit_identical(tmp_path: Path, monkeypatch, direct: str):
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", direct)
    state = odd_state()
    before = io.counters()
    tg.save(tmp_path / "c", state)
    sent = io.counters()["bytes_direct"] - before["bytes_direct"]
    total = sum(v.nbytes for v in state.values())
    if direct == "1":
        assert sent > total // 2, f"only {sent} of {total} bytes went direct"
    else:
        assert sent == 0
    out = fresh(state)
    assert not all(torch.equal(out[k], state[k]) for k in state)
    tg.load(tmp_path / "c", out)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert tg.verify(tmp_path / "c").ok


def test_async_save_writes_staged_pages_direct(tmp_path: Path):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 700))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    before = io.counters()["bytes_direct"]
    h = tg.save(tmp_path / "c", {"model": model, "optim": opt}, async_=True)
    h.result(timeout=120)
    assert io.counters()["bytes_direct"] - before > (1 << 20)
    other = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 700))
    tg.load(tmp_path / "c", {"model": other}, only=["model"])
    assert all(torch.equal(v, want[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_kernel_refusing_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch, refused_at: str):
    """Some filesystems (FUSE, tmpfs before Linux 6.6) answer EINVAL to O_DIRECT at open, some
    devices at the first write (alignment rules): the save then goes buffered and is whole."""
    import errno

    from trainguard.storage import local

    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local.os, "open", fake_open)
    monkeypatch.setattr(local.os, "pwrite", fake_pwrite)
    state = odd_state()
    before = io.counters()["bytes_direct"]
    tg.save(tmp_path / "c", state)
    assert io.counters()["bytes_direct"] == before
    monkeypatch.undo()
    out = fresh(state)
    tg.load(tmp_path / "c", out)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_writer_sends_only_whole_aligned_pages_direct(tmp_path: Path):
    """A write whose address and offset agree modulo a page: head and tail buffered, middle
    direct; one that disagrees: all buffered. The file holds the bytes either way."""
    buf = io.aligned_empty(3 << 20)
    buf.copy_(torch.randint(0, 255, (3 << 20,), dtype=torch.uint8))
    data = io.tensor_bytes(buf)
    w = LocalStorage().open_write(str(tmp_path / "f"), direct=True)
    if not w.direct_ok:
        pytest.skip("this filesystem refuses O_DIRECT")
    w.pwrite(data[100:], 100 + 8192)  # agrees modulo a page
    assert w.direct_bytes and w.direct_bytes % DIRECT_ALIGN == 0 and w.direct_bytes < len(data) - 100
    n = w.direct_bytes
    w.pwrite(data[:], 4 << 20 | 64)  # disagrees: buffered
    assert w.direct_bytes == n
    size = (4 << 20 | 64) + len(data)
    w.finish(size)
    got = (tmp_path / "f").read_bytes()
    assert got[8292 : 8292 + len(data) - 100] == bytes(data[100:])
    assert got[(4 << 20 | 64) :] == bytes(data)


def test_layout_places_large_chunks_at_their_memory_phase():
    offs, size = layout_file([100, 2 << 20, 2 << 20, 10], phases=[None, 64, 5, None])
    assert offs[1] % 4096 == 64  # agrees with the address modulo a page
    assert offs[2] % 4096 == 0  # a phase off the 64-byte grid: plain page alignment
    assert all(o % 64 == 0 for o in offs) and size == offs[3] + 10


def test_direct_writer_preallocates_the_file(tmp_path: Path):
    """reserve(size) allocates the blocks before the first write (few extents, and a full disk is
    found before any byte is written); the finished file holds exactly what was written."""
    w = LocalStorage().open_write(str(tmp_path / "f"), direct=True)
    if not w.direct_ok:
        pytest.skip("this filesystem refuses O_DIRECT")
    w.reserve(8 << 20)
    assert os.stat(tmp_path / "f").st_blocks * 512 >= 8 << 20
    buf = io.aligned_empty(4 << 20)
    buf.fill_(7)
    w.pwrite(io.tensor_bytes(buf), 0)
    w.finish(4 << 20)
    assert (tmp_path / "f").read_bytes() == bytes([7]) * (4 << 20)
