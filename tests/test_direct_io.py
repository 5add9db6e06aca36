"""Direct I/O writes (storage.local): whole pages of large chunks go through O_DIRECT straight
from tensor memory (sync) or the staging pool (async), the bytes around them buffered; the
checkpoint loads bit for bit either way, and a kernel that refuses O_DIRECT gets buffered writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_read_pieces import _evict  # tests/ is on sys.path under pytest
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


def _refuse_o_direct(monkeypatch, call: str, *, at_open: bool) -> set[int]:
    """Make storage.local's kernel refuse O_DIRECT with EINVAL: at open (``at_open``), or at the
    first ``call`` (``pwrite`` or ``preadv``) on an O_DIRECT descriptor. Returns the set of
    O_DIRECT descriptors opened (filled as the code under test opens them)."""
    import errno

    from trainguard.storage import local

    real_open, real_call = os.open, getattr(os, call)
    direct_fds: set[int] = set()

    def fake_open(path, flags, *a, **kw):  # **kw: shutil.rmtree opens with dir_fd=
        if flags & os.O_DIRECT and at_open:
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a, **kw)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_call(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_call(fd, data, offset)

    monkeypatch.setattr(local.os, "open", fake_open)
    monkeypatch.setattr(local.os, call, fake_call)
    return direct_fds


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_kernel_refusing_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch, refused_at: str):
    """Some filesystems (FUSE, tmpfs before Linux 6.6) answer EINVAL to O_DIRECT at open, some
    devices at the first write (alignment rules): the save then goes buffered and is whole."""
    _refuse_o_direct(monkeypatch, "pwrite", at_open=refused_at == "open")
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


def _cold_reads_known(ckpt: Path) -> None:
    from trainguard.storage import _pagecache

    f = next(p for p in ckpt.iterdir() if p.name.endswith(".bin") or p.name.startswith("data"))
    fd = os.open(f, os.O_RDONLY)
    try:
        if _pagecache.cached_fraction(fd) is None:
            pytest.skip("cachestat is not available: every file is read as cached")
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
@pytest.mark.parametrize("direct", ["1", "0"])
def test_cold_load_reads_whole_pages_direct_into_the_tensors(tmp_path: Path, monkeypatch, direct: str):
    """A load of files not in the page cache reads the pages of large chunks with O_DIRECT
    straight into the destination (off with TRAINGUARD_DIRECT_IO=0); the result is the same."""
    state = odd_state()
    tg.save(tmp_path / "c", state)
    _cold_reads_known(tmp_path / "c")
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", direct)
    out = fresh(state)
    _evict(tmp_path / "c")
    before = io.counters()
    tg.load(tmp_path / "c", out)
    got = io.counters()["bytes_read_direct"] - before["bytes_read_direct"]
    assert all(torch.equal(out[k], state[k]) for k in state)
    if direct == "1":
        assert got > (4 << 20), f"only {got} bytes were read direct"
    else:
        assert got == 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_cold_read_refused_by_the_kernel_falls_back_to_buffered(tmp_path: Path, monkeypatch):
    state = odd_state()
    tg.save(tmp_path / "c", state)
    _cold_reads_known(tmp_path / "c")
    direct_fds = _refuse_o_direct(monkeypatch, "preadv", at_open=False)
    out = fresh(state)
    _evict(tmp_path / "c")
    before = io.counters()["bytes_read_direct"]
    tg.load(tmp_path / "c", out)
    assert io.counters()["bytes_read_direct"] == before
    assert direct_fds, "the cold load did not even try O_DIRECT"
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_cold_resharding_read_fills_its_scratch_buffer_direct(tmp_path: Path):
    """A box that is not contiguous in the saved chunk (columns of a matrix) is read through a
    scratch buffer placed at the file offset's page phase: its pages come direct too, and the
    elements land in the right places; a flipped byte in them is still caught."""
    from trainguard.commit import read_manifest
    from trainguard.errors import CorruptCheckpointError
    from trainguard.index import ChunkSource, plan_args
    from trainguard.planner import Box, plan_reads

    w = torch.randn(1024, 1536)
    tg.save(tmp_path / "c", {"w": w})
    _cold_reads_known(tmp_path / "c")
    storage, d = LocalStorage(), str(tmp_path / "c")
    m = read_manifest(storage, d)
    e = m.tensors["w"]
    box = Box((0, 512), (1024, 512))
    ops = plan_reads(plan_args(ChunkSource.of(storage, d, m).chunks("w", e, box)), box, 4, m.block_size, True)
    assert ops and all(op.dest_byte is None for op in ops)  # indirect: through scratch buffers
    dest = torch.zeros(1024, 512)
    _evict(tmp_path / "c")
    before = io.counters()["bytes_read_direct"]
    io.read_targets(storage, d, [io.ReadTarget("w", dest, box, ops)])
    assert io.counters()["bytes_read_direct"] - before > (1 << 20)
    assert torch.equal(dest, w[:, 512:1024])
    c = e.chunks[0]
    with open(tmp_path / "c" / c.file, "r+b") as f:
        f.seek(c.offset + 3 * 1536 * 4 + 600 * 4)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    _evict(tmp_path / "c")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        io.read_targets(storage, d, [io.ReadTarget("w", torch.zeros(1024, 512), box, ops)])


def test_o_direct_reads_only_for_a_sole_reader_on_the_machine(monkeypatch):
    """Several ranks of one machine loading replicated state read the same bytes: through the
    page cache the disk is read once, with O_DIRECT once per rank, so only a sole reader
    (world size 1, or torchrun's LOCAL_WORLD_SIZE=1) reads cold files direct."""
    from types import SimpleNamespace

    from trainguard.loader import _sole_reader

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _sole_reader(SimpleNamespace(world_size=1))
    assert not _sole_reader(SimpleNamespace(world_size=2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per node
    assert _sole_reader(SimpleNamespace(world_size=8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not _sole_reader(SimpleNamespace(world_size=8))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_cold_read_without_direct_goes_through_the_page_cache(tmp_path: Path):
    from trainguard.commit import read_manifest
    from trainguard.index import ChunkSource, plan_args
    from trainguard.planner import full_box, plan_reads

    w = torch.randn(2 << 20)
    tg.save(tmp_path / "c", {"w": w})
    _cold_reads_known(tmp_path / "c")
    storage, d = LocalStorage(), str(tmp_path / "c")
    m = read_manifest(storage, d)
    box = full_box(m.tensors["w"].shape)
    ops = plan_reads(plan_args(ChunkSource.of(storage, d, m).chunks("w", m.tensors["w"], box)), box, 4, m.block_size)
    for direct in (False, True):
        _evict(tmp_path / "c")
        dest = torch.zeros(2 << 20)
        before = io.counters()["bytes_read_direct"]
        io.read_targets(storage, d, [io.ReadTarget("w", dest, box, ops)], direct=direct)
        got = io.counters()["bytes_read_direct"] - before
        assert torch.equal(dest, w) and (got > (4 << 20) if direct else got == 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
        lambda: torch.arange(12, dtype=torch.bfloat16),  # no numpy dtype: the general path
        lambda: torch.ones(5, requires_grad=True),
        lambda: torch.tensor(3.5, dtype=torch.float64),  # 0-d
        lambda: torch.arange(20, dtype=torch.int64)[5:15],  # a view with a storage offset
        lambda: torch.tensor([True, False, True]),
    ],
)
def test_tensor_bytes_are_the_tensors_bytes_without_a_copy(make) -> None:
    """tensor_bytes' numpy shortcut and its general path agree, and both alias the tensor."""
    t = make()
    mv = io.tensor_bytes(t)
    assert bytes(mv) == t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert len(mv) == t.nbytes
    with torch.no_grad():
        t.view(-1)[0] = 1 if t.dtype == torch.bool else 7
    assert bytes(mv[: t.element_size()]) == t.detach().reshape(-1)[:1].view(torch.uint8).numpy().tobytes()
