"""Memory review: what loads and saves hold beyond the state itself.

A resharding load (shards saved on W ranks, read on W' ranks) with checksum verification widens
each read to whole checksum blocks; the bytes outside the rank's part must be read somewhere.
These tests hold the loader to reading row shards' inner blocks straight into the destination
(scratch: the two end blocks, not the rank's share) and column shards through scratch a group
of rows at a time (not a buffer of every row of the chunk at once).
"""

from __future__ import annotations

import os
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainguard as tg
from trainguard import io as tg_io
from trainguard import planner
from trainguard.commit import read_manifest
from trainguard.index import ChunkSource, plan_args
from trainguard.planner import Box, full_box, plan_reads
from trainguard.storage import for_path


def _part(shape: tuple[int, ...], n: int, r: int, dim: int = 0) -> Box:
    step = -(-shape[dim] // n)
    lo = min(r * step, shape[dim])
    hi = min(lo + step, shape[dim])
    offs, sizes = [0] * len(shape), list(shape)
    offs[dim], sizes[dim] = lo, hi - lo
    return Box(tuple(offs), tuple(sizes))


def _rows(shape: tuple[int, ...], n: int, r: int) -> Box:
    return _part(shape, n, r, 0)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 40), st.integers(1, 9), st.integers(1, 5), st.integers(1, 5),
    st.sampled_from([8, 16, 24, 64]), st.integers(0, 1), st.sampled_from([16, 40, 1 << 22]),
)
def test_widened_reads_fill_the_destination_with_bounded_scratch(
    rows: int, cols: int, w: int, w2: int, block: int, dim: int, scratch: int
) -> None:
    """Simulated files: each chunk's bytes hold its elements' global indices (int32). Executing
    the verified read plan of every rank of W' (direct ops into the destination, indirect ones
    through a scratch buffer and ``io._scatter``, as ``read_targets`` does) gives each rank its
    part; every op's checks tile it along the chunk's blocks. Row shards (dim 0): at most two
    blocks per chunk go through scratch (before: the whole widened range of the rank's rows).
    Column shards (dim 1): each indirect op is at most ``SCRATCH_BYTES`` (or a block, or one
    row) plus its two widened ends (before: one op of every row of the chunk)."""
    shape = (rows, cols)
    full = torch.arange(rows * cols, dtype=torch.int32).view(shape)
    chunks, files, foff = [], bytearray(), 64
    for r in range(w):
        b = _part(shape, w, r, dim)
        if not b.numel:
            continue
        sl = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))
        data = full[sl].contiguous().view(torch.uint8).numpy().tobytes()
        off = foff + len(files)
        files += data
        chunks.append((b, "f", off, len(data), [f"{k:016x}" for k in range(-(-len(data) // block))]))
    for r2 in range(w2):
        dest = _part(shape, w2, r2, dim)
        if not dest.numel:
            continue
        out = torch.full(dest.sizes, -1, dtype=torch.int32)
        target = tg_io.ReadTarget("t", out, dest, [])
        with mock.patch.object(planner, "SCRATCH_BYTES", scratch, create=True):
            ops = plan_reads(chunks, dest, 4, block, verify=True)
        scratch_per_chunk: dict[int, int] = {}
        for op in ops:
            c = chunks[op.chunk_index]
            raw = bytes(files[op.offset - foff : op.offset - foff + op.length])
            assert len(raw) == op.length
            pos = 0
            for chk in op.checks:  # whole blocks of the chunk, in order, covering the op
                assert chk.start == pos and (op.offset - c[2] + pos) % block == 0
                assert chk.checksum == c[4][(op.offset - c[2] + pos) // block]
                pos += chk.length
            assert pos == op.length
            if op.dest_byte is not None:
                tg_io.tensor_bytes(out)[op.dest_byte : op.dest_byte + op.length] = raw
            else:
                tg_io._scatter(torch.frombuffer(bytearray(raw), dtype=torch.uint8), target, op)
                scratch_per_chunk[op.chunk_index] = scratch_per_chunk.get(op.chunk_index, 0) + op.length
                row = c[0].sizes[1] * 4
                assert op.length <= max(scratch, block, row) + 2 * block
        sl = tuple(slice(o, o + n) for o, n in zip(dest.offsets, dest.sizes, strict=True))
        assert torch.equal(out, full[sl])
        if dim == 0:
            assert all(n <= 2 * block for n in scratch_per_chunk.values()), scratch_per_chunk


def _peak_rss_extra(fn) -> int:  # noqa: ANN001 - a test helper
    """Peak RSS growth during ``fn()`` (kernel VmHWM, reset first, as bench/measure.py does)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")
    with open("/proc/self/statm", "rb") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    fn()
    with open("/proc/self/status", "rb") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmHWM:"))
    return hwm - base


def test_resharded_row_read_holds_no_copy_of_the_rank_share(tmp_path) -> None:
    """A rank of 3 reading its rows of a 96 MiB tensor saved whole (the same plan and reads as
    ``tg.load`` of a 2-rank FSDP2 checkpoint on 3 ranks; measured there with a 256 MiB weight:
    peak extra RSS 76-88 MiB per rank for an 85 MiB share before, 4-5 MiB after). The rows do
    not start or end on a checksum block: before, the whole widened range (the share and up to
    two blocks) was read into a scratch buffer and copied; now only the two end blocks."""
    shape = (3 * 2048 + 7, 4096)  # int32 rows of 16 KiB: each third ~32 MiB, not block-aligned
    t = torch.arange(shape[0] * shape[1], dtype=torch.int32).view(shape)
    tg.save(tmp_path / "c", {"w": t})
    storage, d = for_path(tmp_path / "c")
    m = read_manifest(storage, d)
    e = m.tensors["w"]
    src = ChunkSource.of(storage, d, m)
    dest = _rows(shape, 3, 1)
    share = dest.numel * 4
    out = torch.empty(dest.sizes, dtype=torch.int32)
    out.view(torch.uint8).fill_(0)  # touched before: its pages are not the peak
    ops = plan_reads(plan_args(src.chunks("w", e, dest)), dest, 4, m.block_size, True)
    assert e.chunks and full_box(shape) != dest
    extra = _peak_rss_extra(lambda: tg_io.read_targets(storage, d, [tg_io.ReadTarget("w", out, dest, ops)]))
    assert torch.equal(out, t[dest.offsets[0] : dest.offsets[0] + dest.sizes[0]])
    assert extra < share // 2, f"peak extra RSS {extra >> 20} MiB reading a {share >> 20} MiB share"


def test_resharded_column_read_goes_through_scratch_a_group_at_a_time(tmp_path) -> None:
    """A rank of 3 reading its columns of a 128 MiB tensor saved whole (``tg.load`` of a
    ``Shard(1)`` DTensor saved on 2 ranks, loaded on 3; measured there with 256 MiB: peak extra
    RSS 129-257 MiB per rank for an 85 MiB share before, 45-77 MiB after, the rest glibc's
    per-thread arenas filling once). Its columns are in every row: before, one op read the whole
    chunk into one scratch buffer (3x the share); now 4 MiB of rows at a time (here 24 MiB peak
in pytest, 4-14 MiB in a bare process: several read threads, the allocator). The second read
    is measured: the first one's freed scratch stays in the allocator's arenas either way."""
    shape = (4096, 8192)
    t = torch.randn(shape)
    tg.save(tmp_path / "c", {"w": t})
    storage, d = for_path(tmp_path / "c")
    m = read_manifest(storage, d)
    e = m.tensors["w"]
    src = ChunkSource.of(storage, d, m)
    dest = _part(shape, 3, 1, 1)
    share = dest.numel * 4
    out = torch.zeros(dest.sizes)
    ops = plan_reads(plan_args(src.chunks("w", e, dest)), dest, 4, m.block_size, True)
    tg_io.read_targets(storage, d, [tg_io.ReadTarget("w", out, dest, ops)])
    out.zero_()
    extra = _peak_rss_extra(lambda: tg_io.read_targets(storage, d, [tg_io.ReadTarget("w", out, dest, ops)]))
    assert torch.equal(out, t[:, dest.offsets[1] : dest.offsets[1] + dest.sizes[1]])
    # before: ~3x the share (the whole chunk in one scratch buffer); a generous bound for the arenas
    assert extra < 2 * share, f"peak extra RSS {extra >> 20} MiB reading a {share >> 20} MiB share"
