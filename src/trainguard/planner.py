"""Pure planning: who writes which chunk, where it goes in the file, and which byte ranges a
rank reads for the boxes it owns. No I/O, no torch.distributed: tested with simulated ranks.

Boxes are ``(offsets, sizes)`` in a tensor's global index space, stored row-major.
``Box``, ``full_box``, ``Regular`` and their helpers live in ``boxes.py`` (re-exported here).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .boxes import Box, Regular, align_up, full_box, row_major_strides  # noqa: F401 - moved there (capture, index, io, manifest)
from .cover import _sweep, check_cover, tiles  # noqa: F401 - their home was here (api, manifest, tests)

# Chunks of at least this size start at a page boundary (O_DIRECT and mmap friendly);
# smaller ones at 64 bytes, which keeps any dtype aligned when the file is mmapped.
PAGE, SMALL_ALIGN, PAGE_ALIGN_FROM = 4096, 64, 1 << 20
# Replicated tensors larger than this are split into row ranges so ranks can share the work.
SPLIT_BYTES = 64 << 20
SCRATCH_BYTES = 4 << 20  # a column shard's rows are read through scratch this much at a time


def row_split(shape: Sequence[int], itemsize: int, max_bytes: int = SPLIT_BYTES) -> list[Box]:
    """Split a tensor into dim-0 row ranges of at most ``max_bytes`` (at least one row each)."""
    nbytes = math.prod(shape) * itemsize
    if not shape or shape[0] < 2 or nbytes <= max_bytes:
        return [full_box(shape)]
    row = nbytes // shape[0]
    rows = max(1, max_bytes // max(row, 1))
    out = []
    for r in range(0, shape[0], rows):
        n = min(rows, shape[0] - r)
        out.append(Box((r,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])))
    return out


@dataclass(frozen=True)
class ReplicatedItem:
    path: str
    shape: tuple[int, ...]
    itemsize: int


def assign_replicated(
    items: Sequence[ReplicatedItem], world_size: int, base_load: Sequence[int] | None = None, rows: bool = False
) -> list[tuple[str, Box, int]]:
    """Deterministically spread replicated tensors over ranks so each writes ~1/N of the bytes.

    Every rank calls this with the same ``items`` (same names, shapes, order-independent) and
    gets the same answer, so no communication is needed beyond agreeing on the item set.
    ``base_load[r]`` is what rank r already writes (its own shards). Returns
    ``(path, box, writer_rank)`` for every piece; with one rank nothing is split, unless
    ``rows`` (``split_state``: every group writes a tensor they share in the same boxes).
    """
    loads = [(int(base_load[r]) if base_load else 0, r) for r in range(world_size)]
    heapq.heapify(loads)
    pieces: list[tuple[int, str, Box]] = []
    for it in items:
        boxes = row_split(it.shape, it.itemsize) if world_size > 1 or rows else [full_box(it.shape)]
        for b in boxes:
            pieces.append((b.numel * it.itemsize, it.path, b))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2].offsets))
    out = []
    for nbytes, path, box in pieces:
        load, r = heapq.heappop(loads)
        out.append((path, box, r))
        heapq.heappush(loads, (load + nbytes, r))
    return out


def layout_file(
    sizes: Sequence[int], start: int = 0, phases: Sequence[int | None] | None = None
) -> tuple[list[int], int]:
    """Byte offsets for consecutive chunks of the given sizes in one file, and the file size.

    Large chunks start on a page, or, when ``phases[i]`` is given (the chunk's memory address
    modulo a page, a multiple of 64), at that position within a page: memory and file then
    agree modulo a page and the chunk's whole pages can be written with O_DIRECT straight
    from the tensor (``storage.local``). Offsets stay 64-aligned either way.
    """
    offsets = []
    pos = start
    for i, n in enumerate(sizes):
        phase = phases[i] if phases is not None else None
        if n < PAGE_ALIGN_FROM:
            pos = align_up(pos, SMALL_ALIGN)
        elif phase is not None and phase % SMALL_ALIGN == 0:
            pos = align_up(pos, SMALL_ALIGN)
            pos += (phase - pos) % PAGE
        else:
            pos = align_up(pos, PAGE)
        offsets.append(pos)
        pos += n
    return offsets, pos


# BlockCheck and ReadOp are made per tensor on every load (10,000 of each for 10,000 small
# tensors): slotted and not frozen, whose __init__ costs 0.3 us instead of 0.4-1.1 us.
@dataclass(slots=True)
class BlockCheck:
    """Verify ``checksum`` over ``length`` bytes at ``start`` within a read buffer."""

    start: int
    length: int
    checksum: str


@dataclass(slots=True)
class ReadOp:
    """Read ``length`` bytes at ``offset`` of ``file``.

    Direct (``dest_byte`` is not None): straight into the destination's bytes at ``dest_byte``.
    Indirect: into a scratch buffer, then copy the elements of ``inter`` out of it, where the
    buffer holds chunk ``chunk`` from its element ``first_elem`` on; or, with ``flat`` =
    ``(skip, dest_byte, n)`` (a checksum block at either end of a widened contiguous read, see
    :func:`plan_reads`), copy its bytes ``[skip, skip + n)`` to the destination's ``dest_byte``.
    """

    file: str
    offset: int
    length: int
    dest_byte: int | None
    chunk: Box
    inter: Box
    first_elem: int
    checks: tuple[BlockCheck, ...]
    chunk_index: int
    flat: tuple[int, int, int] | None = None


def overlapping(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], dest: Box) -> list[int]:
    """Indices of the ``(offsets, sizes)`` boxes that may overlap ``dest`` along dim 0.

    When the boxes are sorted by their dim-0 offset (manifests keep chunks sorted by offsets)
    this bisects, so a rank's read plan costs O(log n + overlap) per tensor instead of O(n)
    box intersections: at 4,096 shards per tensor that is the difference between milliseconds
    and a minute. Unsorted input falls back to a linear filter. 0-d tensors: every box.
    """
    if not dest.sizes:
        return list(range(len(boxes)))
    lo, hi = dest.offsets[0], dest.offsets[0] + dest.sizes[0]
    starts = [b[0][0] for b in boxes]
    if any(a > b for a, b in zip(starts, starts[1:], strict=False)):
        return [i for i, (o, s) in enumerate(boxes) if o[0] < hi and o[0] + s[0] > lo]
    longest = max((b[1][0] for b in boxes), default=0)
    first = bisect.bisect_right(starts, lo - longest)
    last = bisect.bisect_left(starts, hi)
    return [i for i in range(first, last) if boxes[i][0][0] + boxes[i][1][0] > lo]


def plan_reads(
    chunks: Sequence[tuple[Box, str, int, int, Sequence[str]]],
    dest: Box,
    itemsize: int,
    block_size: int,
    verify: bool = True,
) -> list[ReadOp]:
    """Byte ranges to read so that ``dest`` (a box held contiguously by this rank) is filled.

    ``chunks`` are ``(box, file, byte_offset, length, checksums)``. Only ranges overlapping
    ``dest`` are read; with ``verify`` they are widened to whole checksum blocks. A widened
    range whose elements are contiguous in both boxes (row shards resharded: 2 -> 3 ranks) is
    read straight into ``dest`` but for its first and last block, each read into a scratch
    block and copied (``ReadOp.flat``): scratch memory is two blocks, not the rank's share.
    Other ranges (column shards) go through scratch: verified, in windows of whole blocks
    (:func:`_windows`); else in groups of rows (:func:`_row_groups`).
    """
    ops: list[ReadOp] = []
    for ci, (cbox, fname, foff, length, sums) in enumerate(chunks):
        if cbox == dest and length:
            # The common case (a whole tensor, or the very shard this rank holds): the chunk is
            # read whole, straight into the destination. The same op as below, without the box
            # arithmetic (10,000 small tensors: 25 -> 6 us each).
            ops.append(whole_read(cbox, fname, foff, length, sums, block_size, verify, ci))
            continue
        inter = cbox.intersect(dest)
        if inter is None or inter.numel == 0:
            continue
        contiguous = inter.is_contiguous_in(cbox) and inter.is_contiguous_in(dest)
        if verify and not contiguous and itemsize and block_size % itemsize == 0:
            ops += _windows(inter, cbox, fname, foff, length, sums, itemsize, block_size, ci)
            continue
        for part in _row_groups(inter, cbox, dest, itemsize, block_size):
            first = part.flat_start_in(cbox)
            last = _last_flat(part, cbox)
            lo, hi = first * itemsize, (last + 1) * itemsize
            if verify:
                lo = lo // block_size * block_size
                hi = min(align_up(hi, block_size), length)
            b0, b1 = first * itemsize, (last + 1) * itemsize
            contiguous = part.is_contiguous_in(cbox) and part.is_contiguous_in(dest)
            d0 = part.flat_start_in(dest) * itemsize
            # Widened: the blocks wholly inside [b0, b1) go direct; only the end blocks via scratch.
            mid_lo = b0 if b0 == lo else align_up(b0, block_size)
            mid_hi = b1 if b1 == hi else b1 // block_size * block_size
            spans: list[tuple[int, int, int | None, tuple[int, int, int] | None]]  # (a, b, dest byte, flat)
            if not contiguous or (lo, hi) == (b0, b1) or mid_lo >= mid_hi:
                spans = [(lo, hi, d0 if contiguous and (lo, hi) == (b0, b1) else None, None)]
            else:  # the end blocks' bytes outside [b0, b1) are verified, not copied
                spans = [(lo, mid_lo, None, (b0 - lo, d0, mid_lo - b0))] if lo < mid_lo else []
                spans.append((mid_lo, mid_hi, d0 + mid_lo - b0, None))
                if mid_hi < hi:
                    spans.append((mid_hi, hi, None, (0, d0 + mid_hi - b0, b1 - mid_hi)))
            for a, b, dest_byte, flat in spans:
                checks: tuple[BlockCheck, ...] = ()
                if verify:
                    checks = tuple(
                        BlockCheck(k * block_size - a, min(block_size, length - k * block_size), sums[k])
                        for k in range(a // block_size, -(-b // block_size))
                    )
                first_elem = a // itemsize if itemsize else 0
                ops.append(ReadOp(fname, foff + a, b - a, dest_byte, cbox, part, first_elem, checks, ci, flat))
    return ops


def _windows(
    inter: Box, cbox: Box, fname: str, foff: int, length: int, sums: Sequence[str], itemsize: int, block: int, ci: int
) -> list[ReadOp]:
    """The verified read of ``inter`` (not contiguous in chunk ``cbox`` or in the destination: a
    column shard resharded, loaded on one rank or consolidated) as disjoint windows of whole
    checksum blocks, ~SCRATCH_BYTES each, read through scratch in turn; each window's op copies
    the elements of its ``inter`` (the rows it meets) that lie in its bytes (``io._scatter``),
    so a row cut by a window boundary is copied in two parts. Every block of the widened range
    is read and verified once (groups of whole rows overlapped by a block wherever a boundary
    cut a row: up to 2x the bytes read); windows holding none of ``inter`` are not read."""
    first, last = inter.flat_start_in(cbox), _last_flat(inter, cbox)
    lo, hi = first * itemsize // block * block, min(align_up((last + 1) * itemsize, block), length)
    step, row = max(block, SCRATCH_BYTES // block * block), math.prod(cbox.sizes[1:])
    ops = []
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        e0, e1 = a // itemsize, b // itemsize
        if not in_range(inter, cbox, e0, e1):
            continue
        r0, r1 = max(inter.offsets[0], cbox.offsets[0] + e0 // row), min(inter.offsets[0] + inter.sizes[0], cbox.offsets[0] + -(-e1 // row))
        rows = Box((r0, *inter.offsets[1:]), (r1 - r0, *inter.sizes[1:]))
        checks = tuple(BlockCheck(k * block - a, min(block, length - k * block), sums[k]) for k in range(a // block, -(-b // block)))
        ops.append(ReadOp(fname, foff + a, b - a, None, cbox, rows, e0, checks, ci))
    return ops


def in_range(inter: Box, cbox: Box, lo: int, hi: int) -> list[Box]:
    """The elements of ``inter`` whose row-major index in chunk ``cbox`` is in ``[lo, hi)``, as
    boxes: ``inter`` itself when all are; else its whole rows in range and, recursively, the
    parts of the (at most two) rows cut by ``lo`` or ``hi``. ``_windows`` and ``io._scatter``."""
    first, last = inter.flat_start_in(cbox), _last_flat(inter, cbox)
    if last < lo or first >= hi or not inter.numel:
        return []
    if lo <= first and last < hi:
        return [inter]
    c0 = cbox.offsets[0]
    if len(inter.sizes) == 1:
        a, b = max(inter.offsets[0], c0 + lo), min(inter.offsets[0] + inter.sizes[0], c0 + hi)
        return [Box((a,), (b - a,))] if a < b else []
    sub, subc = Box(inter.offsets[1:], inter.sizes[1:]), Box(cbox.offsets[1:], cbox.sizes[1:])
    row, f, la = math.prod(subc.sizes), sub.flat_start_in(subc), _last_flat(sub, subc)
    top = inter.offsets[0] + inter.sizes[0]
    ra, rb = max(inter.offsets[0], c0 - (f - lo) // row), min(top, c0 + (hi - 1 - la) // row + 1)  # whole rows
    out = [Box((ra, *sub.offsets), (rb - ra, *sub.sizes))] if ra < rb else []
    for r in sorted({c0 + lo // row, c0 + (hi - 1) // row}):
        if inter.offsets[0] <= r < top and not ra <= r < rb:
            base = (r - c0) * row
            out += [Box((r, *p.offsets), (1, *p.sizes)) for p in in_range(sub, subc, lo - base, hi - base)]
    return out


def _row_groups(inter: Box, cbox: Box, dest: Box, itemsize: int, block: int) -> list[Box]:
    """``inter`` (read indirectly: not contiguous in chunk ``cbox`` or in ``dest``, as a column
    shard resharded, loaded on one rank or consolidated; read unverified, or with a block that
    is not a multiple of the item size) cut along dim 0 at chunk rows that are multiples of
    ``g``: ~SCRATCH_BYTES (or a block) of the chunk, a multiple of ``block`` when the rows allow.
    Each group's scratch buffer is allocated and dropped in turn (``io._Scratch``), not one for
    every row at once. Verified reads take :func:`_windows`: whole-row groups re-read a block."""
    row, most = math.prod(cbox.sizes[1:]) * itemsize, max(SCRATCH_BYTES, block)
    if len(inter.sizes) < 2 or not row or inter.sizes[0] * row <= most:
        return [inter]
    if inter.is_contiguous_in(cbox) and inter.is_contiguous_in(dest):
        return [inter]
    step = block // math.gcd(block, row) if block else 1  # rows whose bytes are a multiple of the block
    g = max(1, most // row) if step * row > most else step * (most // (step * row))
    out, o, n = [], inter.offsets, inter.sizes
    rel, end = o[0] - cbox.offsets[0], o[0] - cbox.offsets[0] + n[0]
    while rel < end:
        nxt = min(end, (rel // g + 1) * g)
        out.append(Box((cbox.offsets[0] + rel, *o[1:]), (nxt - rel, *n[1:])))
        rel = nxt
    return out


def whole_read(
    box: Box, fname: str, foff: int, length: int, sums: Sequence[str], block_size: int, verify: bool = True, ci: int = 0
) -> ReadOp:
    """The op reading chunk ``ci`` (``length > 0`` bytes at ``foff`` of ``fname``) whole into a
    destination that is exactly its box ``box``: what :func:`plan_reads` plans for it, called
    directly by the loader for whole plain tensors (1 us instead of 2 per tensor)."""
    checks: tuple[BlockCheck, ...] = ()
    if verify:
        if length <= block_size:
            checks = (BlockCheck(0, length, sums[0]),)
        else:
            checks = tuple(BlockCheck(lo, min(block_size, length - lo), sums[b]) for b, lo in enumerate(range(0, length, block_size)))
    return ReadOp(fname, foff, length, 0, box, box, 0, checks, ci)


def _last_flat(inter: Box, outer: Box) -> int:
    last = Box(tuple(o + s - 1 for o, s in zip(inter.offsets, inter.sizes, strict=True)), tuple(1 for _ in inter.sizes))
    return last.flat_start_in(outer)

