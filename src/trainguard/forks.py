"""What a forked child must not inherit from trainguard: the parent's async save in flight, and
its place in the parent's process group.

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
import sys
import threading

from . import async_save, dist, gcpause, io, iostall, replicas, stage
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
    io._POOL = io._BufferPool()  # its lock, held by a writer thread at the fork, hung the child's first save
    replicas._LOCK, dist._MAKING = threading.Lock(), threading.Lock()
    iostall._OPEN.clear()  # the parent's storage calls in flight: none of this process's, never to end here
    _not_a_rank()
    if job is not None and not job.handle.done():
        job.handle.forked_off(os.getppid())


def _not_a_rank() -> None:
    """In the child: when the parent was a rank of an initialised process group, the child (a
    DataLoader worker, an eval process) is none. Its ``DistContext.current()`` is the one-process
    context, so that a ``tg.load`` there reads alone, and the parent's contexts, whose c10d store
    connection it shares, are dropped unused and unclosed. Before, the child's load entered the
    parent's collective rounds as the parent's rank and failed after the liveness bound with
    'the c10d store stopped answering ... rank 0 died or hangs', and a child whose store worker
    had been restarted would have written into the parent's store connection."""
    tdist = sys.modules.get("torch.distributed")
    if dist._CACHE or (tdist is not None and tdist.is_available() and tdist.is_initialized()):
        dist._FORKED_CHILD = True
        dist._CACHE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
