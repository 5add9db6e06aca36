"""Host staging buffers for async saves: one reusable pool per process, pinned once CUDA is in use.

Who calls what (``async_save``, every rank, one save holding the pool at a time):

0. training thread, first in the save call: :func:`protected_tensors` says which tensors only
   an optimizer's ``step()`` changes (staged later, by the save thread) and which are copied now.
1. training thread, inside the save call: :meth:`StagingPool.acquire` gives one slot per tensor
   that must be copied at once (buffers, RNG, plain tensors); these always get a slot.
2. save thread, once the "begin" round fixed which chunks this rank writes:
   :meth:`StagingPool.background_bytes` sizes the buffer for the parameters/optimizer state
   (all of them, or what the cap leaves), :meth:`StagingPool.buffer` hands it out, and the
   save thread stages into it batch after batch (copy, write, copy, ...: ``stagecopy``).
3. save thread, when the save is committed or failed: :meth:`StagingPool.release`.

Why reuse: touching fresh memory costs 0.5-0.7 s per GiB on these machines and pinned
allocations are slower still, so both arenas are allocated once and reused by every later save
of the same state; they grow only when the state grows. See ``docs/async.md``, "Memory cap".
The tensor keys (:func:`protected_tensors`, :class:`StorageKeys`, :func:`zero_copy_ok`, ...) live in
``stagekeys.py``; they stay importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import memroom
from .buffers import aligned_empty
from .errors import CheckpointError, nonneg_int
from .planner import PAGE, PAGE_ALIGN_FROM
from .stagekeys import (  # noqa: F401 (moved there, kept importable here)
    StorageKeys,
    optimizer_writes,
    protected_tensors,
    storage_key,
    tensor_key,
    zero_copy_ok,
)

log = logging.getLogger("trainguard")
ROOM_SOURCES = "host MemAvailable and memory cgroup limits, less the training step's own peak"


def memory_room() -> int | None:
    """:func:`memroom.room`, this rank's share of it: ranks on one host (``LOCAL_WORLD_SIZE``, set by
    torchrun) allocate their pools at the same time. None: cannot tell."""
    free = memroom.room()
    return None if free is None else free // memroom.local_ranks()


ALIGN = 64  # slot alignment in bytes: every dtype can view a slot, and copies stay vector-aligned
# Large slots start on a page, like large chunks in the file (planner.layout_file): written with O_DIRECT.


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_start(pos: int, nbytes: int) -> int:
    """Where a slot of ``nbytes`` goes at or after ``pos``: on a page if large, else 64-aligned."""
    return -(-pos // PAGE) * PAGE if nbytes >= PAGE_ALIGN_FROM else round_up(pos)


def slot_room(sizes: Sequence[int]) -> int:
    """Bytes that slots of these sizes need, laid out one after another with ``slot_start``."""
    end = 0
    for n in sizes:
        end = slot_start(end, n) + n
    return round_up(end)


class StagingPool:
    """Two growing, reusable uint8 arenas: ``sync`` slots (copies made in the save call) and the
    ``background`` buffer (parameters and optimizer state, staged by the save thread).

    ``pin``: page-locked memory, what makes device-to-host copies asynchronous (default: once
    this process has initialised CUDA, checked at each allocation: see :attr:`pin`).
    ``max_bytes``: the most both arenas together should hold (None: no cap); only the sync slots
    may exceed it, plus at most one checksum block for the background buffer when the sync slots
    leave less. Thread-safe.
    """

    def __init__(self, *, max_bytes: int | None = None, pin: bool | None = None) -> None:
        if max_bytes is not None:  # an int >= 0 (a str, a float, True: a TypeError saying so)
            nonneg_int(max_bytes, f"max_staging_bytes={max_bytes!r}: pass a byte count (an int >= 0), or None for no cap")
        self.max_bytes = max_bytes
        self._pin = pin
        self._pinned: dict[str, bool] = {}  # arena -> allocated page-locked
        self._sync: torch.Tensor | None = None
        self._background: torch.Tensor | None = None
        self._sync_used = 0
        self._lock = threading.Lock()
        self._in_use = False
        self.allocations = 0  # how many times an arena was (re)allocated: constant in a steady state
        self._short: tuple[int, int] | None = None  # (wanted, given) when memory last capped the background buffer
        self._short_sync = 0  # the call's copies (bytes) that last did not fit in memory (fit_sync)

    @property
    def pin(self) -> bool:
        """Whether the next allocation is page-locked. Not when CUDA is merely available: page-locking
        creates a CUDA context (~0.5 GB of device memory) in a process that may train on the CPU,
        and a process forked after that fails in torch's CPU ``optimizer.step()``, which asks for
        the current CUDA stream (a CUDA error, seen on an H200 with torch 2.11)."""
        return torch.cuda.is_initialized() if self._pin is None else self._pin

    @property
    def capacity(self) -> int:
        """Bytes held by both arenas now."""
        return sum(0 if a is None else a.numel() for a in (self._sync, self._background))

    @property
    def in_use(self) -> bool:
        return self._in_use

    def acquire(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Hold the pool and return one sync slot (uint8 tensor) of ``sizes[i]`` bytes each.

        Called in the save call (training thread). These slots ignore the cap: their tensors
        cannot wait. Raises ``CheckpointError`` if the pool is already held.
        """
        with self._lock:
            if self._in_use:
                raise CheckpointError(
                    "the staging pool is held by a save still in flight; wait for it (handle.result()) first"
                )
            offsets: list[int] = []
            end = 0
            for n in sizes:
                offsets.append(slot_start(end, n))
                end = round_up(offsets[-1] + n)
            self._grow("_sync", end)
            arena = self._sync
            slots = [  # before the pool is marked held: a Ctrl-C here (thousands of slots) left it held for good
                arena[off : off + n] if n and arena is not None else torch.empty(0, dtype=torch.uint8)
                for off, n in zip(offsets, sizes, strict=True)
            ]
            self._sync_used = end
            self._in_use = True
        return slots

    def background_bytes(self, need: int, largest: int, *, block: int) -> int:
        """Size of the background buffer for ``need`` bytes of chunks, the largest ``largest``.

        No cap: ``need`` (everything in one batch). With a cap: what the sync slots leave of it,
        rounded down to a multiple of ``block`` (pieces of a split chunk start on a checksum
        block), but at least ``min(largest, block)`` so that every chunk can be staged.
        """
        if self.max_bytes is None or need == 0:
            return self._in_memory(need, largest, block)
        room = max(self.max_bytes - self._sync_used, 0)
        if room >= block:
            room = room // block * block
        room = max(room, min(largest, block))
        return self._in_memory(min(room, need), largest, block)

    def _in_memory(self, size: int, largest: int, block: int) -> int:
        """:meth:`background_bytes`: ``size``, or less when growing the buffer to it would take more
        memory than this process can still use (:func:`memory_room`): then the buffer is what fits,
        and the save stages in batches as under a cap (a warning each time the figures change)."""
        have = 0 if self._background is None else self._background.numel()
        free = memory_room() if size - have > memroom.SMALL else None
        if free is None or size - have <= free:
            return size
        fits = min(max((have + free) // block * block, min(largest, block)), size)
        if self._short != (size, fits):
            self._short = (size, fits)
            log.warning("trainguard: async save: a staging buffer for all %s the save thread stages (parameters, "
                        "optimizer state) would take more memory than this process can still use (%s: %s); it stages them in "
                        "batches of %s instead, and optimizer.step() waits until the last batch is copied. Pass "
                        "max_staging_bytes to choose the batch size, or give the job more memory",
                        memroom.describe(size), memroom.describe(free), ROOM_SOURCES, memroom.describe(fits))
        return fits

    def fit_sync(self, now: list[Any], later: list[Any]) -> tuple[list[Any], list[Any], bool]:
        """``async_save.start_async_save``, training thread, before :meth:`acquire`: the leaves to copy
        in the call (``now``) and those the save thread stages (``later``), and whether the call must
        wait for ``staged()``. When the copies in the call do not fit in the memory this process can
        still use (:func:`memory_room`; a save of a model without its optimizer copies every weight
        in the call), none is made there: the save thread stages every leaf in batches that fit and
        the call waits until the last is copied, the stall of a sync save instead of the OOM killer."""
        sizes = [lf.tensor.nbytes for lf in now]
        grow = slot_room(sizes) - (0 if self._sync is None else self._sync.numel())
        free = memory_room() if grow > memroom.SMALL else None
        if free is None or grow <= free:
            return now, later, False
        if self._short_sync != sum(sizes):  # once, not at every save of a steady state
            self._short_sync = sum(sizes)
            log.warning("trainguard: async save: copying %s of tensors in the save call would take more memory than "
                        "this process can still use (%s: %s); the save thread stages them in batches that fit and "
                        "the call waits until they are copied (the stall of a synchronous save)",
                        memroom.describe(sum(sizes)), memroom.describe(free), ROOM_SOURCES)
        return [], later + now, True

    def background_for(self, sizes: Sequence[int], *, block: int) -> int:
        """:meth:`background_bytes` for chunks of these sizes, laid out by :func:`pack_batches`
        (one page of slack each: a chunk may start at its source's phase within a page)."""
        return self.background_bytes(slot_room(sizes) + PAGE * len(sizes), max(sizes, default=0), block=block)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The background buffer (uint8, ``nbytes``), valid until :meth:`release`; only the
        holder of the pool (its save thread) calls it."""
        with self._lock:
            if not self._in_use:
                raise CheckpointError("staging buffer requested without holding the pool (internal error)")
            self._grow("_background", nbytes)
            arena = self._background
        return arena[:nbytes] if arena is not None else torch.empty(0, dtype=torch.uint8)

    def _grow(self, name: str, nbytes: int) -> None:
        arena, pin = getattr(self, name), self.pin
        size = 0 if arena is None else arena.numel()
        if nbytes <= size and (arena is None or not pin or self._pinned[name]):
            return  # reuse: the steady state allocates nothing
        # Here: a larger arena, or a pageable one to be made pinned (CUDA came into use), once.
        nbytes = max(nbytes, size)
        del arena
        setattr(self, name, None)  # drop the old arena before allocating the new one (peak = new size)
        if pin:  # page-locked allocations start on a page
            setattr(self, name, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        else:
            setattr(self, name, aligned_empty(nbytes, PAGE))
        self._pinned[name] = pin
        self.allocations += 1

    def release(self) -> None:
        """Give the slots back (the save that held them is committed or failed)."""
        with self._lock:
            self._in_use = False
            self._sync_used = 0

    def trim(self) -> None:
        """Free both arenas (e.g. after training); the next save allocates them again."""
        with self._lock:
            if self._in_use:
                raise CheckpointError("cannot trim the staging pool while a save holds it")
            self._sync = self._background = None


_DEFAULT: dict[tuple[int | None, bool | None], StagingPool] = {}
_DIRECT: list[int | None] = []  # the cap of the last direct (not a manager's) async save


def _cap(max_bytes: Any) -> int | None:  # a pool's key: a numpy int or 0-d tensor cap as its value
    return None if max_bytes is None else operator.index(max_bytes)


def default_pool(max_bytes: int | None = None, users: Iterable[Any] = (), managed: bool = False) -> StagingPool:
    """The process-wide pool for a cap, ``async_save``'s call. Every save drops idle pools of caps no open async manager
    of ``users`` has (review57j), but a manager's save (``managed``) keeps the last direct ``tg.save``'s: a model's manager
    and an EMA's direct save (or manager) with different caps each keep theirs, not reallocated (review57d, 57l)."""
    key = (_cap(max_bytes), None)
    kept = {_cap(getattr(u, "max_staging_bytes", None)) for u in users} | {key[0]} | set(_DIRECT if managed else ())
    for k in list(_DEFAULT):
        if not _DEFAULT[k].in_use and k[0] not in kept:
            del _DEFAULT[k]
    _DIRECT[:] = _DIRECT if managed else [key[0]]
    if key not in _DEFAULT:
        _DEFAULT[key] = StagingPool(max_bytes=key[0])
    return _DEFAULT[key]


def pool_capacity(max_bytes: int | None) -> int:
    """Bytes the process-wide pool for this cap holds now (0: none yet); ``ramroom`` asks it."""
    return getattr(_DEFAULT.get((_cap(max_bytes), None)), "capacity", 0)  # default_pool's key: a 0-d tensor cap too


_FORKED_OFF: list[StagingPool] = []  # a forked child's inherited pools: kept, never used there


def forget_pools_in_child() -> None:
    """``async_save``'s ``os.register_at_fork`` hook, in a forked child: the pools are the parent's
    (one may be held by a save thread the child does not have, its lock too), so the child starts
    with none. Kept, not freed: their pages are shared copy-on-write, and a pinned arena's free
    would go through CUDA, which a forked child must not touch."""
    global _DEFAULT
    _FORKED_OFF.extend(_DEFAULT.values())
    _DEFAULT = {}


def trim_idle_pools(users: Iterable[Any] = ()) -> None:
    """Free the arenas of every process-wide pool no save holds and no open async manager of ``users`` saves with
    (``async_save.release_staging``). A pool another thread's save takes meanwhile is kept: ``trim`` raised there, out of the manager's ``close()``,
    whose run lock then stayed held (checked, then trimmed: the save could take it in between)."""
    kept = {_cap(getattr(u, "max_staging_bytes", None)) for u in users}
    for key, pool in list(_DEFAULT.items()):
        with contextlib.suppress(CheckpointError):  # held (trim looks under the pool's lock)
            if key[0] not in kept:
                pool.trim()

