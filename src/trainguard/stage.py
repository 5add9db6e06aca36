"""Host staging buffers for async saves: one reusable arena per process, pinned when CUDA is present.

``async_save.start_async_save`` (training thread, every rank) asks :meth:`StagingPool.acquire`
for one host slot per tensor it stages, copies into them (small, fast-changing tensors at once,
parameters and optimizer state from its background thread), and calls :meth:`StagingPool.release`
when the save is committed or failed. One save holds the pool at a time (one save in flight).

Why an arena: touching fresh memory costs 0.5-0.7 s per GiB on these machines and pinned
allocations are slower still, so the buffers are allocated once and reused by every later save
of the same state; the arena grows only when the state grows. ``max_bytes`` caps it: tensors
that do not fit get no slot and are written straight from the live tensors (see
``docs/async.md``, "Memory cap").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .errors import CheckpointError

ALIGN = 64  # slot alignment in bytes: every dtype can view a slot, and copies stay vector-aligned


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StagingPool:
    """A growing, reusable uint8 arena cut into per-tensor slots.

    ``pin``: page-locked memory (default: when CUDA is available; it is what makes
    device-to-host copies asynchronous). ``max_bytes``: the most the arena may hold (None: no cap).
    Thread-safe: acquire/release may be called from different threads.
    """

    def __init__(self, *, max_bytes: int | None = None, pin: bool | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_staging_bytes={max_bytes}: pass a byte count >= 0, or None for no cap")
        self.max_bytes = max_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._arena: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._in_use = False
        self.allocations = 0  # how many times the arena was (re)allocated: stays 1 for a steady state

    @property
    def capacity(self) -> int:
        """Bytes held by the arena now."""
        return 0 if self._arena is None else self._arena.numel()

    @property
    def in_use(self) -> bool:
        return self._in_use

    def acquire(self, sizes: Sequence[int], *, required: int = 0) -> list[torch.Tensor | None]:
        """Slots (uint8 tensors) for ``sizes`` bytes each, in order; ``None`` for those past the cap.

        The first ``required`` sizes always get a slot (they hold state that cannot wait: it is
        allowed to exceed the cap). Raises ``CheckpointError`` if the pool is already held.
        """
        with self._lock:
            if self._in_use:
                raise CheckpointError(
                    "the staging pool is held by a save still in flight; wait for it (handle.result()) first"
                )
            offsets: list[int | None] = []
            end = 0
            for i, n in enumerate(sizes):
                need = end + _round_up(n)
                if i >= required and self.max_bytes is not None and need > self.max_bytes:
                    offsets.append(None)
                    continue
                offsets.append(end)
                end = need
            self._ensure(end)
            self._in_use = True
            arena = self._arena
        out: list[torch.Tensor | None] = []
        for off, n in zip(offsets, sizes, strict=True):
            if off is None:
                out.append(None)
            elif n == 0 or arena is None:
                out.append(torch.empty(0, dtype=torch.uint8))
            else:
                out.append(arena[off : off + n])
        return out

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return  # reuse: the steady state allocates nothing
        self._arena = None  # drop the old arena before allocating the new one (peak = new size)
        self._arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1

    def release(self) -> None:
        """Give the slots back (the save that held them is committed or failed)."""
        with self._lock:
            self._in_use = False

    def trim(self) -> None:
        """Free the arena (e.g. after training); the next save allocates it again."""
        with self._lock:
            if self._in_use:
                raise CheckpointError("cannot trim the staging pool while a save holds it")
            self._arena = None


_DEFAULT: dict[tuple[int | None, bool | None], StagingPool] = {}


def default_pool(max_bytes: int | None = None) -> StagingPool:
    """The process-wide pool for a given cap (one per distinct ``max_bytes``)."""
    key = (max_bytes, None)
    pool = _DEFAULT.get(key)
    if pool is None:
        for k in list(_DEFAULT):  # a different cap replaces the old pool: never two arenas alive
            if not _DEFAULT[k].in_use:
                del _DEFAULT[k]
        pool = _DEFAULT[key] = StagingPool(max_bytes=max_bytes)
    return pool


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
