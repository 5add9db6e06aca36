"""What a forked child must not inherit from trainguard: the parent's async save in flight.

A process forked while an async save runs (DataLoader workers, forked at every epoch's
``iter()``; an eval or Hogwild process from ``multiprocessing`` with the fork start method) has
none of the parent's threads, so none of its save thread. It used to inherit the save as if it
were its own: ``tg.load`` and ``optimizer.step()`` there waited forever for its staging, an async
``tg.save`` there found the staging pool held, and every DataLoader worker's exit (multiprocessing
runs threading's exit hooks) warned that it waited for the save. The parent's save goes on in
the parent alone; the child writes and commits nothing of it. Registered by importing this module
(``trainguard/__init__.py``).
"""

from __future__ import annotations

import os
import threading

from . import async_save, gcpause, io, stage
from .storage import _direct, local


def _after_fork_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: the child starts with no save in flight, no
    uncollected error of the parent's, fresh module locks and staging pools (a lock held by another
    thread at the fork stays held for good in the child), the garbage collector as the forking
    thread left it; a handle of the parent's save in flight fails in the child (``result()``
    raises) instead of waiting forever."""
    job = async_save._INFLIGHT
    async_save._INFLIGHT = async_save._UNCOLLECTED = None
    async_save._LOCK, async_save.STARTING = threading.Lock(), threading.RLock()
    stage.forget_pools_in_child()
    gcpause.after_fork_in_child()  # a save or load of another thread paused the collector
    io._COUNTERS_LOCK, _direct._LOCK, local._LOCK = threading.Lock(), threading.Lock(), threading.Lock()
    if job is not None and not job.handle.done():
        job.handle.forked_off(os.getppid())


os.register_at_fork(after_in_child=_after_fork_in_child)
