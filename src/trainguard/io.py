"""Moving bytes: parallel writes of chunks with per-block checksums, parallel reads of byte
ranges straight into destination tensors, with verification.

Called by ``api.save``/``api.load`` on each rank for that rank's own file and reads; safe to
run from a background thread (the async writer). Two streams by default (measured faster here).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import reads, writegaps
from .buffers import PAGE_ALIGN, ScratchPool, aligned_empty, tensor_bytes
from .errors import DiskFullError
from .fdlimit import ensure_room
from .manifest import checksum
from .planner import PAGE, Box, ReadOp, in_range, row_major_strides
from .storage.base import FileReader, Storage
from .streamjobs import run_parallel

PIECE = 64 << 20  # bytes per pwrite of a large chunk (a multiple of every block size we use)
COALESCE = 16 << 20  # small chunks are gathered into buffers of this size, one write each
SMALL = 1 << 20  # chunks below this are coalesced
DEFAULT_BLOCK = 4 << 20  # checksum granularity
STREAMS = 2
# One more read thread while files are read with O_DIRECT: two threads leave the device idle
# while they checksum what they read. Measured on this VM (3.1 GB, 2 files, after drop_caches,
# alternating rounds, python -m bench.cold_ab): 3 threads median 1.12 s, 2 threads 1.20 s;
# 4 threads no better than 3.
COLD_DIRECT_EXTRA = 1

_COUNTERS = {"bytes_read": 0, "bytes_written": 0, "bytes_direct": 0, "bytes_read_direct": 0}
_COUNTERS_LOCK = threading.Lock()


def counters() -> dict[str, int]:
    """This process's running totals of checkpoint bytes read and written (a debug counter).

    ``read_targets`` adds what it reads (checksum widening included), ``write_file`` what it
    writes; ``bytes_read_direct``/``bytes_direct``: the parts that went through O_DIRECT.
    """
    with _COUNTERS_LOCK:
        return dict(_COUNTERS)


def _count(key: str, n: int) -> None:
    with _COUNTERS_LOCK:
        _COUNTERS[key] += n


@dataclass
class WriteChunk:
    """One chunk to write: ``data`` (its bytes) at ``offset`` in the rank's file."""

    data: memoryview
    offset: int

    @property
    def length(self) -> int:
        return len(self.data)


class _BufferPool:
    """Reusable coalescing buffers (page-aligned): fresh memory is slow to fault in on these machines."""

    def __init__(self) -> None:
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def get(self) -> memoryview:
        with self._lock:
            if self._free:
                return self._free.pop()
        return tensor_bytes(aligned_empty(COALESCE + PAGE_ALIGN))

    def put(self, b: memoryview) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(b)


_POOL = _BufferPool()


def _tasks(chunks: Sequence[WriteChunk], block: int) -> list[tuple[int, ...]]:
    """Split the chunks into independent write tasks of bounded size, in file order: ``(0, i,
    start, n)`` writes bytes ``start:start+n`` of chunk ``i`` from its memory, ``(1, i, j, ...)``
    copies small chunks into one coalescing buffer and writes that. Tuples of ints, not closures:
    an async save's tasks live while it writes (seconds), and tracked objects that survive that
    long push CPython towards a full collection (a closure task was six; the collector stops
    tracking a tuple of ints at its first look)."""
    tasks: list[tuple[int, ...]] = []
    batch: list[int] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            tasks.append((1, *batch))
        batch, batch_bytes = [], 0

    order = sorted(range(len(chunks)), key=lambda i: chunks[i].offset)
    small = min(SMALL, block)  # a coalesced chunk gets one checksum: it must fit in one block
    for i in order:
        c = chunks[i]
        if c.length >= small:
            flush()
            piece = max(block, PIECE // block * block)
            for start in range(0, c.length, piece):
                tasks.append((0, i, start, min(piece, c.length - start)))
        else:
            span = c.offset + c.length - (chunks[batch[0]].offset if batch else c.offset)
            if batch and span > COALESCE:
                flush()
            batch.append(i)
            batch_bytes += c.length
    flush()
    return tasks


def _run_task(task: tuple[int, ...], chunks: Sequence[WriteChunk], w: Any, block: int, sums: list[list[str]]) -> None:
    """One task of :func:`_tasks`, on a write stream: write it and fill in its chunks' checksums."""
    if task[0] == 0:
        _, i, start, n = task
        c = chunks[i]
        view = c.data[start : start + n]
        w.pwrite(view, c.offset + start)
        for b in range(0, n, block):
            sums[i][(start + b) // block] = checksum(view[b : b + block])
        return
    idx = task[1:]
    base = chunks[idx[0]].offset
    end = chunks[idx[-1]].offset + chunks[idx[-1]].length
    buf = _POOL.get()
    try:
        # Bytes sit at the same position modulo a page as in the file: whole pages can go direct.
        view = buf[base % PAGE_ALIGN :]
        for i in idx:
            c = chunks[i]
            rel = c.offset - base
            view[rel : rel + c.length] = c.data
            if c.length:  # hash the copy: it is still in the cache
                sums[i][0] = checksum(view[rel : rel + c.length])
        w.pwrite(view[: end - base], base)
    finally:
        _POOL.put(buf)


def open_writer(storage: Storage, path: str) -> Any:
    """``storage.open_write(path)``, with O_DIRECT asked for where the storage offers it (local
    files, ``storage.local``: a write whose memory address and file offset agree modulo a page
    goes direct). Called by :func:`write_batches` and by the RAM tier's copy to disk (``tiers``)."""
    return storage.open_write(path, direct=True) if getattr(storage, "direct_io", False) else storage.open_write(path)


def reserve(w: Any, size: int) -> None:
    """Allocate a new file's ``size`` bytes before writing, where its writer can (``reserve``: local
    files written direct); a full disk is found here, before any byte is written."""
    room = getattr(w, "reserve", None)
    if room is not None:
        room(size)


def write_file(
    storage: Storage,
    path: str,
    chunks: Sequence[WriteChunk],
    size: int,
    *,
    block: int = DEFAULT_BLOCK,
    streams: int = STREAMS,
    fault: Callable[[str], None] | None = None,
) -> list[list[str]]:
    """Write every chunk into a new file of ``size`` bytes, fsync it, and return the per-block
    checksums of each chunk (in the order given). Gaps between chunks are left as holes.

    The sync save path (``api._write_rank``): chunks point straight into tensor memory."""
    return write_batches(storage, path, [chunks], size, block=block, streams=streams, fault=fault)


def write_batches(
    storage: Storage,
    path: str,
    batches: Iterable[Sequence[WriteChunk]],
    size: int,
    *,
    block: int = DEFAULT_BLOCK,
    streams: int = STREAMS,
    fault: Callable[[str], None] | None = None,
) -> list[list[str]]:
    """Like :func:`write_file`, for chunks produced in batches (the async path's capped staging).

    On storage that offers it (local files), whole pages of a chunk whose memory address and
    file offset agree modulo a page are written with O_DIRECT (see ``storage.local``; off with
    ``TRAINGUARD_DIRECT_IO=0``); the planner places large chunks so that they agree.

    Each batch is written completely (2 streams, 64 MiB pieces, small chunks coalesced) before
    the next one is requested from ``batches``, so a producer may reuse one batch's buffers for
    the next (copy, write, copy, ...). Returns the checksums of every chunk of every batch, in
    the order produced. Small chunks of a batch are coalesced into one write *gaps included*,
    so batches must come in file order: no chunk of one batch may lie between two of another's.
    A chunk may be a piece of a larger chunk: pieces that start on a
    ``block`` boundary of their chunk give that chunk's checksums when concatenated. The
    iterator is closed if writing fails (a generator's ``finally`` runs then).
    """
    sums: list[list[str]] = []
    total = 0
    w = open_writer(storage, path)
    it = iter(batches)
    try:
        reserve(w, size)
        if fault:
            fault("write_begin")
        end = written = 0
        gaps = hasattr(w, "hole")  # writegaps.declare: writers that take holes (object stores)
        for batch in it:
            lo = min((c.offset for c in batch), default=end)
            if lo < end:
                raise ValueError(f"write_batches: a batch starts at byte {lo}, before the previous one ended ({end})")
            end = max((c.offset + c.length for c in batch), default=end)
            part = [[""] * (-(-c.length // block)) for c in batch]
            tasks = _tasks(batch, block)
            if gaps:  # an object store's parts with a gap: sent, not held (local files: nothing to tell, no work)
                written = writegaps.declare(w, tasks, batch, written)
            run_parallel(tasks, streams, fault, "write_piece",
                         run=lambda task, b=batch, p=part: _run_task(task, b, w, block, p))
            sums += part
            total += sum(c.length for c in batch)
        if fault:
            fault("before_fsync")
        w.finish(size)
    except DiskFullError as e:
        w.abort()
        _close(it)
        # Say how much the whole file needed, not only the piece that failed.
        raise DiskFullError(e.errno, f"{e.strerror}. This data file needs {size} bytes in all") from e
    except BaseException:
        w.abort()
        _close(it)
        raise
    _count("bytes_written", total)
    _count("bytes_direct", getattr(w, "direct_bytes", 0))
    return sums


def _close(it: Iterator[Any]) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


@dataclass
class ReadTarget:
    """Where a tensor's bytes go: ``dest`` (contiguous CPU) holds box ``box`` of tensor ``path``."""

    path: str
    dest: torch.Tensor
    box: Box
    ops: list[ReadOp]


def read_targets(
    storage: Storage,
    directory: str,
    targets: Iterable[ReadTarget],
    *,
    streams: int = STREAMS,
    check_file: Callable[[str], None] | None = None,
    direct: bool = True,
) -> int:
    """Execute every read op, verifying checksums; returns the number of bytes read.

    Called by ``loader._load``, ``export`` and ``consolidate``. Ops are cut into pieces that
    are checksummed right after they are read (:mod:`.reads`), when the reader allows pieces
    (``piece_bytes``: local files, fsspec stores); a reader without it reads each op whole, then verifies it.

    ``targets`` may be a generator (the loader plans tensor by tensor), consumed by the read
    threads as they need work. ``check_file(name)``: called once per data file before it is
    opened (the loader checks its size there). ``direct=False``: no O_DIRECT for cold files.
    """
    readers: dict[str, FileReader] = {}
    total = 0

    small = reads.SmallOps()  # small ops: read in groups
    pool = ScratchPool(streams + COLD_DIRECT_EXTRA + 1)  # a partial block's or window's scratch

    def pieces() -> Iterator[reads.Piece | reads.ScatterPiece]:
        nonlocal total
        for t in targets:
            ops = t.ops
            in_place = ops[0].dest_byte is not None if len(ops) == 1 else any(op.dest_byte is not None for op in ops)
            dest = tensor_bytes(t.dest) if in_place else None
            for op in ops:
                r = readers.get(op.file)
                if r is None:
                    if check_file is not None:
                        check_file(op.file)
                    kw = {"direct": direct} if getattr(storage, "direct_io", False) else {}
                    ensure_room(len(readers) + 1)  # every file stays open to the end: may pass 1024 fds
                    r = readers[op.file] = storage.open_read(storage.join(directory, op.file), **kw)
                total += op.length
                grouped = small.take(r, t.path, op, dest)
                yield from _op_pieces(r, t, op, dest, pool) if grouped is None else grouped
        yield from small.rest()

    def reading_direct() -> bool:
        return any(getattr(r, "direct_ok", False) for r in list(readers.values()))

    gen = reads.batched(pieces())
    try:
        reads.run(gen, streams, extra=COLD_DIRECT_EXTRA if streams > 1 else 0, want_extra=reading_direct)
    finally:
        gen.close()
        for r in readers.values():  # every one, even after a close that raised (an object store's reader)
            _count("bytes_read_direct", getattr(r, "direct_bytes", 0))
            with contextlib.suppress(OSError):
                r.close()
    _count("bytes_read", total)
    return total


def _op_pieces(reader: FileReader, t: ReadTarget, op: ReadOp, dest: memoryview | None, pool: ScratchPool) -> list[reads.Piece]:
    """The pieces of one op: direct ops read into the destination's bytes; indirect ones into a
    scratch buffer whose elements are copied into place once its last piece is verified."""
    size = getattr(reader, "piece_bytes", None)
    if op.dest_byte is not None:
        assert dest is not None
        return reads.split(reader, dest[op.dest_byte : op.dest_byte + op.length], op, t.path, size)
    scratch = _Scratch(op.length, op.offset % PAGE, pool)
    return reads.split(reader, scratch.get, op, t.path, size, lambda: scratch.done(lambda s: _scatter(s, t, op)))


class _Scratch:
    """An indirect op's scratch buffer, taken by its first piece to run and handed back once its
    elements are copied out (not every op of a resharding load at once); it starts at the op's
    file offset modulo a page (``phase``): a cold read can fill its whole pages with O_DIRECT.
    From ``pool`` (``buffers.ScratchPool``): mappings reused, not holes in the malloc heap."""

    def __init__(self, n: int, phase: int, pool: ScratchPool) -> None:
        self.n, self.phase, self.pool = n, phase, pool
        self.base: torch.Tensor | None = None
        self.t: torch.Tensor | None = None
        self.mv: memoryview | None = None
        self.lock = threading.Lock()

    def get(self) -> memoryview:
        with self.lock:
            if self.mv is None:
                self.base, self.t = self.pool.take(self.n, self.phase)
                self.mv = tensor_bytes(self.t)
            return self.mv

    def done(self, use: Callable[[torch.Tensor], None]) -> None:
        """``use(buffer)``, then the buffer back to the pool (after the op's last piece)."""
        with self.lock:
            base, t, self.base, self.t, self.mv = self.base, self.t, None, None, None
        assert base is not None and t is not None
        try:
            use(t)
        finally:
            del t
            self.pool.give(base)


def _scatter(scratch: torch.Tensor, t: ReadTarget, op: ReadOp) -> None:
    """Copy the elements of ``op.inter`` that an indirect op's scratch buffer holds (it holds
    chunk ``op.chunk`` from element ``op.first_elem`` on: all of them, but for a window of a
    column shard's read, ``planner._windows``) into ``t.dest`` (an op with ``flat``: the bytes
    it names, into the destination's bytes)."""
    if op.flat is not None:
        skip, at, n = op.flat
        tensor_bytes(t.dest)[at : at + n] = tensor_bytes(scratch)[skip : skip + n]
        return
    typed = scratch.view(t.dest.dtype)
    cstrides = row_major_strides(op.chunk.sizes)
    dest = t.dest.detach().view(t.box.sizes)  # detach: a Parameter's in-place copy_ is refused
    for box in in_range(op.inter, op.chunk, op.first_elem, op.first_elem + typed.numel()):
        # as_strided's offset counts from the start of the storage, not of the (aligned) view.
        src = typed.as_strided(box.sizes, cstrides, typed.storage_offset() + box.flat_start_in(op.chunk) - op.first_elem)
        rel = tuple(slice(o - d, o - d + s) for o, d, s in zip(box.offsets, t.box.offsets, box.sizes, strict=True))
        dest[rel].copy_(src)
