"""Copying chunks into a staging buffer, batch by batch, for the writer (``io.write_batches``).

Who calls what: the async save thread (``asyncjob._stage_background``) lays its chunks out in
the pool's background buffer with :func:`pack_batches` and copies them with a
:class:`BatchCopier`; a sync save of device chunks (``streams.host_batches``, the calling
thread) uses :func:`pack_batches` with a plain copy; the save call copies the tensors that
cannot wait with :func:`copy_into` (``async_save``, training thread).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from .buffers import holds
from .planner import PAGE_ALIGN_FROM
from .stage import round_up, slot_start
from .streamjobs import run_parallel

Batch = list[tuple[int, int, torch.Tensor]]  # (index of the chunk, byte offset in it, host bytes)


def pack_batches(
    items: Iterable[tuple[int, torch.Tensor, bool, int]],
    buf: torch.Tensor,
    *,
    block: int,
    copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    flush: Callable[[], None] = lambda: None,
    last: Callable[[], None] = lambda: None,
) -> Iterator[Batch]:
    """Batches for ``io.write_batches`` (in file order), copying chunks into the reusable ``buf``.

    ``items``: ``(index, uint8 source bytes, ready, page phase)``; a ``ready`` source (already
    host memory) joins the batch as it is, the others are copied with ``copy(slot, source
    piece)`` (returns the host bytes). Large chunks start on a page of ``buf`` (plus ``phase``:
    where the planner put them within a page of the file, so that they can go O_DIRECT), and
    a chunk larger than what is left is split into pieces that start on a checksum ``block`` of
    their chunk. When ``buf`` is full the batch is handed over (``flush()`` first), and
    ``buf`` is reused once the writer asks for the next. ``last()`` runs before the final
    batch is handed over. Used by the async save thread (``asyncjob._stage_background``)
    and by sync saves of device chunks (``streams.host_batches``)."""
    room = buf.numel()
    batch: Batch = []
    pos = 0
    for i, src, ready, phase in items:
        n, start = src.numel(), 0
        if ready or n == 0:
            batch.append((i, 0, src))
            continue
        while start < n:
            lead = phase if n >= PAGE_ALIGN_FROM else 0
            if pos == 0 and lead and _piece(room - lead, n - start, block) == 0:
                # An empty buffer too small for the phase and a piece (a cap of one block, a zero-copy save's
                # rest): no phase, the piece goes buffered. Else: empty batches for good, staged() never set.
                lead = 0
            pos = min(slot_start(pos, n) + lead, room)
            piece = _piece(room - pos, n - start, block)
            if piece == 0:  # the buffer is full: write it, then reuse it
                flush()
                yield batch
                batch, pos = [], 0
                continue
            batch.append((i, start, copy(buf[pos : pos + piece], src[start : start + piece])))
            pos, start = round_up(pos + piece), start + piece
    flush()
    last()
    yield batch


def _piece(free: int, left: int, block: int) -> int:
    """``pack_batches``: the bytes of a chunk (``left`` of it still to copy) that fit in ``free``
    bytes of the buffer: all that is left, else whole checksum blocks (0: none fits)."""
    return left if left <= free else max(free, 0) // block * block


def drained(items: list[Any]) -> Iterator[Any]:
    """``items`` in order, each removed from the list as it is taken (``asyncjob._stage_background``
    feeds ``pack_batches`` so): an entry and its byte view are freed once staged instead of living
    until the save ends (gcpause.py says why that matters)."""
    items.reverse()
    while items:
        yield items.pop()


# The save thread's copies of CPU chunks into the staging buffer: memmove on this many threads,
# in pieces of at most COPY_PIECE bytes. Measured here (1 GB model + Adam, 680 chunks, from a
# thread other than the main one, medians of 9): 74 ms on two threads against 104 ms for torch's
# copy_ chunk by chunk (each copy_ of a few MiB is an OpenMP region, slower outside the main
# thread: 87 ms in it) and 71 ms for one copy_ of the same bytes in a single tensor.
COPY_THREADS = 2
COPY_PIECE = 8 << 20


class BatchCopier:
    """The copies of one save's ``pack_batches`` (``asyncjob._stage_background``, save thread):
    :meth:`copy` starts a device source's copy at once (non-blocking, on a stream per device that
    waits for ``events``, recorded at the save's call) and queues a CPU source's; :meth:`flush`
    (before a batch is handed to the writer) copies the queued ones (:func:`copy_many`) and
    waits for the streams, so that every byte of the batch has landed when it returns."""

    def __init__(self, events: Mapping[int, Any]) -> None:
        self.streams: dict[int, Any] = {}
        for idx, ev in events.items():
            s = torch.cuda.Stream(device=idx)
            s.wait_event(ev)
            self.streams[idx] = s
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, slot: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``slot`` (uint8) will hold ``src`` (uint8 bytes of the same size) once :meth:`flush` returns."""
        if src.device.type != "cpu":  # a GPU's: on its stream; another device's: at once
            return copy_into(slot, src, self.streams.get(src.device.index) if src.is_cuda else None)
        self.queued.append((slot, src))
        return slot

    def flush(self) -> None:
        queued, self.queued = self.queued, []
        try:
            copy_many(queued)
        except BaseException:
            self.settle()
            raise
        for s in self.streams.values():
            s.synchronize()

    def settle(self) -> None:
        """On a failure: wait for the device copies already started, whose destination (the pool's
        buffer) is released next and may be reused by the next save; their own errors are ignored
        (the failure is raised). Before, a copy or writer failing partway through a batch left the
        batch's non-blocking GPU copies writing into a released buffer."""
        for s in self.streams.values():
            with contextlib.suppress(Exception):
                s.synchronize()

    def batches(self, items: Iterable[tuple[int, torch.Tensor, bool, int]], buf: torch.Tensor, *, block: int,
                copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], flush: Callable[[], None],
                last: Callable[[], None]) -> Iterator[Batch]:
        """``pack_batches`` whose copies go through this copier (``asyncjob._stage_background``):
        whatever ends it early (a copy raising, the writer closing it after a failed write) first
        waits for the device copies in flight (:meth:`settle`)."""
        try:
            yield from pack_batches(items, buf, block=block, copy=copy, flush=flush, last=last)
        except BaseException:
            self.settle()
            raise


def copy_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int = COPY_THREADS) -> None:
    """Copy the bytes of every ``(dst, src)`` pair of contiguous CPU tensors of one byte size with
    ``memmove`` (it releases the GIL) on ``threads`` threads, large ones in pieces; returns once all
    are copied, raises the first error after every thread stopped. Called by :meth:`BatchCopier.flush`."""
    jobs = []
    for dst, src in pairs:
        n = src.nbytes
        cpu = dst.device.type == src.device.type == "cpu"
        if dst.nbytes != n or not (cpu and dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"copy_many: cannot memmove {tuple(src.shape)} ({src.device}) into {tuple(dst.shape)} ({dst.device})")
        if n and not holds(src):  # else a crash (torch's copy_ too: a segfault here); dst is the pool's
            raise ValueError(f"copy_many: the memory of a {tuple(src.shape)} tensor was freed or shrunk (storage resize_)")
        d, s = dst.data_ptr(), src.data_ptr()
        jobs += [partial(ctypes.memmove, d + o, s + o, min(COPY_PIECE, n - o)) for o in range(0, n, COPY_PIECE)]
    run_parallel(jobs, threads)


def copy_into(slot: torch.Tensor, src: torch.Tensor, stream: object | None = None) -> torch.Tensor:
    """Copy ``src`` (contiguous, any device) into the uint8 ``slot``; returns the typed host view.

    CPU sources copy synchronously (torch releases the GIL). CUDA sources copy non-blocking on
    ``stream`` when given; the caller synchronizes that stream before reading the slot.
    """
    dst = slot.view(src.dtype).view(src.shape) if src.numel() else torch.empty(src.shape, dtype=src.dtype)
    if src.numel() == 0:
        return dst
    if src.is_cuda and stream is not None:
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)
    return dst
