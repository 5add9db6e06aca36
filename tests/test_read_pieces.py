"""Loads read large ops in block-aligned pieces, each checksummed right after it is read
(``trainguard.reads``). These tests use small checksum blocks and pieces so that one tensor
is many pieces: every byte still lands in place, every block is verified by exactly one
piece, and a flipped byte in the middle is reported with its tensor and byte range, for
direct reads (into the destination) and indirect ones (resharding, via a scratch buffer).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import api, reads
from trainguard.commit import read_manifest
from trainguard.errors import CorruptCheckpointError
from trainguard.index import ChunkSource, plan_args
from trainguard.io import ReadTarget, read_targets
from trainguard.planner import BlockCheck, Box, ReadOp, plan_reads
from trainguard.storage import LocalStorage, _pagecache, local
from trainguard.storage.local import _LocalReader

from conftest import evict_page_cache as _evict

BLOCK = 64 << 10


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints saved with 64 KiB checksum blocks, loaded in 256 KiB pieces (cached or not)."""
    monkeypatch.setattr(api, "DEFAULT_BLOCK", BLOCK)
    monkeypatch.setattr(_LocalReader, "piece_bytes", 4 * BLOCK)
    monkeypatch.setattr(local, "COLD_READ_PIECE", 4 * BLOCK)


def _flip(ckpt: Path, name: str, at: int) -> int:
    """Flip one byte ``at`` bytes into tensor ``name``'s chunk; returns its file offset."""
    m = read_manifest(LocalStorage(), str(ckpt))
    c = m.tensors[name].chunks[0]
    pos = c.offset + at
    with open(ckpt / c.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
    return pos


def _byte_range(msg: str) -> tuple[int, int]:
    lo, hi = msg.split("(bytes ")[1].split(")")[0].split("..")
    return int(lo), int(hi)


def test_large_tensor_in_pieces_round_trips_and_a_middle_flip_is_named(tmp_path: Path, small_blocks: None) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300_001, generator=g), "b": torch.randn(77, generator=g)}  # ~1.2 MB: 19 blocks
    tg.save(tmp_path / "ck", state)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "ck", fresh)
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    pos = _flip(tmp_path / "ck", "w", 600_001)  # in block 9, piece 3
    with pytest.raises(CorruptCheckpointError) as ei:
        tg.load(tmp_path / "ck", fresh)
    assert "'w'" in str(ei.value)
    lo, hi = _byte_range(str(ei.value))
    assert lo <= pos < hi and hi - lo == BLOCK


def test_indirect_reads_in_pieces_reshard_and_detect_a_flip(tmp_path: Path, small_blocks: None) -> None:
    g = torch.Generator().manual_seed(1)
    full = torch.randn(512, 600, generator=g)  # 1.2 MB, one chunk
    tg.save(tmp_path / "ck", {"t": full})
    storage, d = LocalStorage(), str(tmp_path / "ck")
    m = read_manifest(storage, d)
    name = "t"
    e = m.tensors[name]
    box = Box((100, 250), (300, 200))  # a column band: strided in the chunk, so indirect
    ops = plan_reads(plan_args(ChunkSource.of(storage, d, m).chunks(name, e, box)), box, 4, m.block_size)
    assert ops and all(op.dest_byte is None for op in ops) and sum(len(op.checks) for op in ops) > 4
    dest = torch.zeros(300, 200)
    read_targets(storage, d, [ReadTarget(name, dest, box, ops)])
    assert torch.equal(dest, full[100:400, 250:450])
    pos = _flip(tmp_path / "ck", name, (250 * 600 + 300) * 4)  # inside the band's rows
    with pytest.raises(CorruptCheckpointError) as ei:
        read_targets(storage, d, [ReadTarget(name, torch.zeros(300, 200), box, ops)])
    lo, hi = _byte_range(str(ei.value))
    assert repr(name) in str(ei.value) and lo <= pos < hi


@pytest.mark.parametrize("piece", [None, 1, 3 * BLOCK, 4 * BLOCK, 10 * BLOCK])
def test_split_covers_the_op_and_verifies_each_block_once(piece: int | None) -> None:
    length = 9 * BLOCK + 100
    checks = tuple(BlockCheck(s, min(BLOCK, length - s), f"{s:016x}") for s in range(0, length, BLOCK))
    box = Box((0,), (length,))
    op = ReadOp("f", 4096, length, 0, box, box, 0, checks, 0)
    mv = memoryview(bytearray(length))
    pieces = reads.split(None, mv, op, "x", piece)  # type: ignore[arg-type]
    pos, seen = 0, []
    for p in pieces:
        assert p.base == pos
        assert piece is None or p.length <= max(piece, BLOCK + 100)
        seen += [(c.start, c.length, c.checksum) for c in p.checks]
        assert all(p.base <= c.start and c.start + c.length <= p.end for c in p.checks)
        pos = p.end
    assert pos == length
    assert seen == [(c.start, c.length, c.checksum) for c in checks]


def test_split_reads_an_op_whose_checks_do_not_tile_it_as_one_piece() -> None:
    box = Box((0,), (3 * BLOCK,))
    checks = (BlockCheck(0, BLOCK, "a"), BlockCheck(2 * BLOCK, BLOCK, "c"))  # a gap: not from plan_reads
    op = ReadOp("f", 0, 3 * BLOCK, 0, box, box, 0, checks, 0)
    pieces = reads.split(None, memoryview(bytearray(3 * BLOCK)), op, "x", BLOCK)  # type: ignore[arg-type]
    assert [(p.base, p.end, len(p.checks)) for p in pieces] == [(0, 3 * BLOCK, 2)]


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_an_uncached_file_is_read_in_cold_pieces_and_a_flip_is_still_named(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(3_000_000, generator=g)}  # 12 MB: 3 blocks of 4 MiB
    tg.save(tmp_path / "ck", state)
    pos = _flip(tmp_path / "ck", "w", 5_000_001)  # in the second block
    _evict(tmp_path / "ck")
    m = read_manifest(LocalStorage(), str(tmp_path / "ck"))
    r = LocalStorage().open_read(str(tmp_path / "ck" / m.tensors["w"].chunks[0].file))
    try:
        if _pagecache.cached_fraction(r.fd) is not None:  # cachestat answers: the file is cold
            want = local.COLD_DIRECT_PIECE if r.direct_ok else local.COLD_READ_PIECE
            assert r.piece_bytes == want
    finally:
        r.close()
    with pytest.raises(CorruptCheckpointError) as ei:
        tg.load(tmp_path / "ck", {"w": torch.zeros(3_000_000)})
    lo, hi = _byte_range(str(ei.value))
    assert "'w'" in str(ei.value) and lo <= pos < hi
    _flip(tmp_path / "ck", "w", 5_000_001)  # flip it back: a cold load is then exact
    _evict(tmp_path / "ck")
    fresh = {"w": torch.zeros(3_000_000)}
    tg.load(tmp_path / "ck", fresh)
    assert torch.equal(fresh["w"], state["w"])


def test_cached_fraction_samples_the_whole_file(tmp_path: Path) -> None:
    """The estimate looks at ranges spread over the file: evicting the first half of a 64 MiB
    file reads about half, evicting all of it about nothing."""
    f = tmp_path / "data"
    n = 64 << 20
    with open(f, "wb") as fh:
        fh.write(os.urandom(1 << 20) * 64)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(f, os.O_RDONLY)
    try:
        if _pagecache.cached_fraction(fd) is None:
            pytest.skip("cachestat is not available on this kernel")
        os.pread(fd, n, 0)  # everything cached
        assert _pagecache.cached_fraction(fd) > 0.9
        os.posix_fadvise(fd, 0, n // 2, os.POSIX_FADV_DONTNEED)
        assert 0.3 < _pagecache.cached_fraction(fd) < 0.7
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert _pagecache.cached_fraction(fd) < 0.1
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_cold_small_tensors_are_read_in_groups_and_a_flip_is_named(tmp_path: Path, monkeypatch) -> None:
    """From a cold file, small tensors are read a group at a time (one scattering read of up to
    32 MiB straight into their destinations, in file order, which is the order the loader plans
    them in), then verified one by one: every tensor lands in place, and a flipped byte names
    its own tensor."""
    g = torch.Generator().manual_seed(4)
    sizes = [int(s) for s in torch.randint(100, 60_000, (300,), generator=g)]
    state = {f"layer{i}.w": torch.randn(n, generator=g) for i, n in enumerate(sizes)}  # ~36 MB, 2 files
    tg.save(tmp_path / "ck", state)
    m = read_manifest(LocalStorage(), str(tmp_path / "ck"))
    by_file: dict[str, list[int]] = {}
    for name in m.tensors:  # the manifest lists tensors in file order: front to back in each file
        c = m.tensors[name].chunks[0]
        by_file.setdefault(c.file, []).append(c.offset)
    assert all(offs == sorted(offs) for offs in by_file.values())
    _evict(tmp_path / "ck")
    r = LocalStorage().open_read(str(tmp_path / "ck" / next(iter(by_file))))
    cold_known = r.cold
    r.close()
    if not cold_known:
        pytest.skip("cachestat is not available: every file is read as cached")
    groups: list[int] = []
    real = reads.ScatterPiece.run
    monkeypatch.setattr(reads.ScatterPiece, "run", lambda self: (groups.append((len(self.ops), self.limit)), real(self))[1])
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "ck", fresh)
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    assert sum(n for n, _ in groups) == len(state) and len(groups) <= 8, groups  # a few reads, not 300
    assert {lim for _, lim in groups} == {reads.COLD_SCATTER_BYTES}  # the cold files' larger groups
    pos = _flip(tmp_path / "ck", "layer123.w", 4 * 500 + 3)
    _evict(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError) as ei:
        tg.load(tmp_path / "ck", {k: torch.zeros_like(v) for k, v in state.items()})
    lo, hi = _byte_range(str(ei.value))
    assert "'layer123.w'" in str(ei.value) and lo <= pos < hi


def _warm(ckpt: Path) -> None:
    for f in ckpt.iterdir():
        f.read_bytes()


def test_cached_small_tensors_are_read_in_scatter_groups_and_a_flip_is_named(tmp_path: Path, monkeypatch) -> None:
    """Small tensors of a cached file: one preadv per group straight into the destinations
    (gaps skipped), every tensor verified in place, a corrupt one named; a large one read as usual."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i:03d}": torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g) for i in range(300)}
    state["big"] = torch.randn(600_000, generator=g)  # 2.4 MB: pieces, not a group
    tg.save(tmp_path / "ck", state)
    _warm(tmp_path / "ck")
    groups: list[int] = []
    real = reads.ScatterPiece.run
    monkeypatch.setattr(reads.ScatterPiece, "run", lambda self: (groups.append(len(self.ops)), real(self))[1])
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "ck", fresh)
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    assert sum(groups) == 300 and 1 < len(groups) <= 300 // 2  # grouped, and more than one group
    _flip(tmp_path / "ck", "t123", 4)
    _warm(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="'t123'"):
        tg.load(tmp_path / "ck", fresh)


def test_a_short_scatter_read_falls_back_to_reads_op_by_op(tmp_path: Path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(6)
    state = {f"t{i}": torch.randn(500 + i, generator=g) for i in range(40)}
    tg.save(tmp_path / "ck", state)
    _warm(tmp_path / "ck")
    real, calls = _LocalReader.readv_into, []
    monkeypatch.setattr(_LocalReader, "readv_into", lambda self, bufs, off: (calls.append(off), real(self, bufs[:1], off))[1])
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "ck", fresh)
    assert calls and all(torch.equal(fresh[k], state[k]) for k in state)


class _Probe:
    """A stand-in piece that records which thread ran it and waits at a barrier, bounded by the
    barrier's own timeout."""

    def __init__(self, barrier: threading.Barrier | None, seen: list[int]) -> None:
        self.barrier, self.seen = barrier, seen

    def run(self) -> None:
        self.seen.append(threading.get_ident())
        if self.barrier is not None:
            self.barrier.wait()  # BrokenBarrierError unless 3 threads run at once (within its timeout)


def test_run_adds_the_extra_thread_only_while_it_is_wanted() -> None:
    """Three threads meet at a 3-party barrier only if the extra one runs beside the two; with
    ``want_extra`` false the extra thread stops after its first piece."""
    seen: list[int] = []
    barrier = threading.Barrier(3, timeout=10)
    reads.run([_Probe(barrier, seen) for _ in range(3)], 2, extra=1, want_extra=lambda: True)
    assert len(set(seen)) == 3
    with pytest.raises(threading.BrokenBarrierError):
        reads.run([_Probe(threading.Barrier(3, timeout=0.5), []) for _ in range(2)], 2, extra=0)
    seen, asked = [], []  # want_extra is asked by the extra thread only, after each of its pieces

    def no() -> bool:
        asked.append(1)
        return False

    reads.run([_Probe(None, seen) for _ in range(400)], 2, extra=1, want_extra=no)
    assert len(seen) == 400 and len(asked) <= 1


@pytest.mark.parametrize("at", [0, 100_003, BLOCK // 4 - 1, 2 * BLOCK // 4 + 7])  # first byte, mid, last of block 0/1
def test_cached_blocks_are_read_and_hashed_in_parts_and_a_flip_is_named(
    tmp_path: Path, small_blocks: None, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """A file in the page cache: each checksum block is read in ``hash_sub`` parts, hashed as
    they arrive (streaming xxh3 gives the block's checksum); a flipped byte anywhere in a block,
    the last part of a block included, names that block."""
    sub = 24 << 10  # does not divide the 64 KiB block: the last part of each block is shorter
    monkeypatch.setattr(_LocalReader, "hash_sub", sub)
    calls: list[int] = []
    real = _LocalReader.readinto

    def counting(self: _LocalReader, buf: memoryview, offset: int) -> None:
        calls.append(len(buf))
        real(self, buf, offset)

    monkeypatch.setattr(_LocalReader, "readinto", counting)
    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(400_000, generator=g)}  # 1.6 MB (pieces, not a scatter group): 24 blocks + a partial one
    tg.save(tmp_path / "ck", state)
    _warm(tmp_path / "ck")
    fresh = {"w": torch.zeros(400_000)}
    tg.load(tmp_path / "ck", fresh)
    assert torch.equal(fresh["w"], state["w"])
    assert calls and max(calls) == sub and min(calls) < sub  # read in parts, short last parts
    pos = _flip(tmp_path / "ck", "w", at * 4 if at else 0)
    _warm(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError) as ei:
        tg.load(tmp_path / "ck", {"w": torch.zeros(400_000)})
    lo, hi = _byte_range(str(ei.value))
    assert "'w'" in str(ei.value) and lo <= pos < hi and hi - lo == BLOCK
