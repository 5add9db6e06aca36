"""A rank's synchronous write (``api._write_rank``, on the calling thread of every rank):
its chunks split over one or two data files, written in parallel straight from the tensors'
memory; chunks held by a device (CUDA) reach the host through one bounded, reused buffer
(:func:`host_batches`). The async path writes one file from its staging buffers
(``api._write_staged``)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import layout as layout_mod
from .buffers import as_bytes
from .capture import Leaf, chunk_view
from .errors import CheckpointError
from .faults import fault
from .io import DEFAULT_BLOCK, WriteChunk, write_file
from .planner import PAGE, PAGE_ALIGN_FROM, Box, layout_file
from .stage import StagingPool
from .stagecopy import Batch, pack_batches
from .storage import Storage
from .storage.local import page_phase

# Below this, one file is enough; above, a second file written in parallel pays off.
TWO_FILES_FROM = 64 << 20
# Threads per file (one file or two): one copies and hashes a buffer of small tensors
# while the other's write is on the disk (10,000 tensors, 1.88 GB: 1.10-1.24 s with 1 per
# file, 1.04-1.10 s with 2, 1.00 s with 3; the 3 GB GPT state unchanged, 1.02 vs 1.04 s).
FILE_STREAMS = 2


def split_streams(mine: list[tuple[Leaf, Any]], lengths: list[int]) -> list[int]:
    """Stream (file) of each chunk: buffered writes to one file serialize on the kernel's inode
    lock (ext4), so a rank writes two files in parallel (measured: raw 1 stream 1.0 GB/s, 2 files
    2.1 GB/s on the 3 GB state). Regular parts (format 2) stay in stream 0, where their index
    points; explicit chunks balance the bytes."""
    out = [0] * len(mine)
    if sum(lengths) < TWO_FILES_FROM or len(mine) < 2:
        return out
    explicit = [lf.regular is None for lf, _b in mine]
    loads = [sum(n for n, e in zip(lengths, explicit) if not e), 0]
    # Largest first, ties in chunk order (a stable sort, reverse included: as by -length).
    for i in sorted(range(len(mine)), key=lengths.__getitem__, reverse=True):
        if explicit[i]:
            out[i] = g = 0 if loads[0] <= loads[1] else 1
            loads[g] += lengths[i]
    return out


def write_streams(
    storage: Storage, work: str, rank: int, cpu: list[memoryview], streams: list[int], block: int
) -> tuple[list[int], list[list[str]], list[str], dict[str, int]]:
    """Write each stream's chunks to its own file, the files in parallel (``FILE_STREAMS`` threads each);
    returns per-chunk offsets, checksums (per ``block`` bytes, the manifest's block size) and
    file names, and every file's size."""
    groups = sorted(set(streams)) or [0]
    offsets: list[int] = [0] * len(cpu)
    sums: list[list[str]] = [[] for _ in cpu]
    by_group = {g: layout_mod.data_file(rank, g) for g in groups}
    names = [by_group[g] for g in streams]
    files: dict[str, int] = {}
    jobs = []
    for g in groups:
        idx = [i for i, s in enumerate(streams) if s == g]
        phases = [page_phase(cpu[i]) if len(cpu[i]) >= PAGE_ALIGN_FROM else None for i in idx]
        offs, size = layout_file([len(cpu[i]) for i in idx], phases=phases)
        for i, o in zip(idx, offs):
            offsets[i] = o
        name = by_group[g]
        files[name] = size
        jobs.append((idx, name, [WriteChunk(cpu[i], o) for i, o in zip(idx, offs)], size))

    def run(job: tuple[list[int], str, list[WriteChunk], int]) -> None:
        idx, name, wchunks, size = job
        got = write_file(
            storage, storage.join(work, name), wchunks, size, block=block,
            streams=FILE_STREAMS, fault=lambda p: fault(p, rank),
        )
        for i, s in zip(idx, got):
            sums[i] = s

    if len(jobs) == 1:
        run(jobs[0])
    else:
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="trainguard-file") as ex:
            for f in [ex.submit(run, j) for j in jobs]:
                f.result()
    return offsets, sums, names, files


# Host bytes for a sync save's device chunks: copied in batches of at most this much, each
# written before the next is copied into the same buffer (kept for later saves, pinned when
# CUDA is present). The peak host memory of a sync save of GPU state is this, not the state.
HOST_BATCH = 256 << 20
_HOST_POOL: StagingPool | None = None


def needs_host_copy(t: torch.Tensor) -> bool:
    """Whether a chunk must be copied to host memory before it can be written (a seam for tests)."""
    return not t.is_cpu


def has_device_chunks(mine: list[tuple[Leaf, Box]]) -> bool:
    """Whether some chunk of ``mine`` must be copied to the host first (then: :func:`host_batches`)."""
    return any(needs_host_copy(lf.tensor) for lf, _box in mine)


def host_batches(mine: list[tuple[Leaf, Box]]) -> tuple[list[int | None], Iterator[Batch]]:
    """The ``stage`` of ``api.persist_and_commit`` for a sync save that holds device chunks
    (``api._write_rank``, calling thread): the page phase of each chunk's source and batches
    of host bytes in file order (``stagecopy.pack_batches``). CPU chunks are written from their
    own memory; device chunks go through this process's host pool, capped at ``HOST_BATCH``
    (a second sync save running meanwhile in another thread gets a pool of its own)."""
    views = [chunk_view(lf, box) for lf, box in mine]
    copy = [needs_host_copy(v) and v.numel() > 0 for v in views]
    phases: list[int | None] = [0 if c else (v.data_ptr() % PAGE if v.numel() else None) for v, c in zip(views, copy)]
    return phases, _host_batches([(i, as_bytes(v), not c, 0) for i, (v, c) in enumerate(zip(views, copy))])


def _host_batches(items: list[tuple[int, torch.Tensor, bool, int]]) -> Iterator[Batch]:
    global _HOST_POOL
    pool = _HOST_POOL
    if pool is None or pool.max_bytes != HOST_BATCH:
        pool = _HOST_POOL = StagingPool(max_bytes=HOST_BATCH)
    try:
        pool.acquire([])
    except CheckpointError:  # held by another thread's sync save
        pool = StagingPool(max_bytes=HOST_BATCH)
        pool.acquire([])
    try:
        buf = pool.buffer(pool.background_for([b.numel() for _i, b, ready, _p in items if not ready], block=DEFAULT_BLOCK))
        yield from pack_batches(items, buf, block=DEFAULT_BLOCK, copy=lambda slot, src: slot.copy_(src))
    finally:
        pool.release()
