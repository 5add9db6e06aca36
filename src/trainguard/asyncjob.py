"""One async save's staging state (``_Job``) and the save thread's background copies (``_stage_background``).

Moved out of ``async_save.py``, which imports every name here and alone calls them: ``start_async_save``
(training thread) builds the ``_Job``; its save thread (``async_save._run`` -> ``_stage`` -> ``_batches``,
or ``_write_live`` once ``step()`` waits) copies the chunks it still has to stage with ``_stage_background``,
and ``_run`` calls ``_Job.release`` when the save ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import gcpause
from .handle import SaveHandle
from .io import DEFAULT_BLOCK
from .stage import StagingPool
from .stagecopy import Batch, BatchCopier, drained
from .stagekeys import StorageKeys


class _Job:
    """One async save's staging state, shared by the training thread and the save thread."""

    def __init__(self, handle: SaveHandle, pool: StagingPool, optimizers: list[torch.optim.Optimizer]) -> None:
        self.handle = handle
        self.pool = pool
        self.optimizer_ids = {id(o) for o in optimizers}
        self.copies: dict[int, torch.Tensor] = {}  # id(leaf) -> host copy made in the call
        self.later: set[int] = set()  # id(leaf) of leaves the save thread stages (its chunks only)
        self.storages = StorageKeys(())  # of those leaves' memory: a step() writing one waits
        self.error: BaseException | None = None
        self.cuda_events: dict[int, Any] = {}  # device index -> event recorded at save time
        self.zero_copy = False  # write protected CPU chunks from their own memory (see _write_live)
        self.began: bool | None = False  # its thread began (_run); None: cancelled before it did
        self.go = threading.Event()  # set once thread.start() returned: _run waits for it, not holding the GIL

    def release(self) -> None:
        """The save ended (its thread, ``_run``) or never got a thread (``start_async_save``): drop its
        copies and leaves (staged by now: nothing asks), release the staging pool and the collector."""
        self.copies.clear()
        self.later, self.storages = set(), StorageKeys(())
        self.pool.release()
        gcpause.release(self.handle.gc_hold)


Todo = list[tuple[int, torch.Tensor, bool, int]]  # (index, the chunk's bytes (uint8), already a host copy, page phase)


def _stage_background(job: _Job, todo: Todo) -> Iterator[Batch]:
    copier = BatchCopier(job.cuda_events)
    buf = job.pool.buffer(job.pool.background_for([b.numel() for _, b, ready, _p in todo if not ready], block=DEFAULT_BLOCK))
    h = job.handle

    def copy(slot: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        h.staged_background_bytes += src.numel()
        return copier.copy(slot, src)

    def flush() -> None:  # the batch's copies are done before it is written
        copier.flush()
        h.staging_batches += 1

    yield from copier.batches(drained(todo), buf, block=DEFAULT_BLOCK, copy=copy, flush=flush, last=h.set_staged)  # last: step() may run
