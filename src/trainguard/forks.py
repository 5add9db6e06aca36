"""What a forked child must not inherit from trainguard: the parent's async save in flight, its
place in the parent's process group, and the parent's open ``CheckpointManager`` (:func:`manager_call`).

A process forked while an async save runs (DataLoader workers, forked at every epoch's
``iter()``; an eval or Hogwild process from ``multiprocessing`` with the fork start method) has
none of the parent's threads, so none of its save thread. It used to inherit the save as if it
were its own: ``tg.load`` and ``optimizer.step()`` there waited forever for its staging, an async
``tg.save`` there found the staging pool held, and every DataLoader worker's exit (multiprocessing
runs threading's exit hooks) warned that it waited for the save. The parent's save goes on in
the parent alone; the child writes and commits nothing of it. Registered by importing this module
(``trainguard/__init__.py``'s ``_boot``, at the package's first use; ``onethread``, for every
``CheckpointManager``; an async ``api.start_save``), which also registers :mod:`.exitdrain`'s second call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from . import async_save, dist, forkreset, io, policies, replicas, stage
from .errors import CheckpointError


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
    forkreset.after_fork_in_child()  # gcpause, iostall, storage: what a torch-free reader imports
    io._COUNTERS_LOCK = threading.Lock()
    io._POOL = io._BufferPool()  # its lock, held by a writer thread at the fork, hung the child's first save
    replicas._LOCK, dist._MAKING = threading.Lock(), threading.Lock()
    _not_a_rank()
    _sigterm_as_before()
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


def _sigterm_as_before() -> None:
    """In the child: SIGTERM's handler back to the one the parent's ``CheckpointManager.open()`` replaced
    (through a chain of managers: the first one's). The manager's handler only sets a flag on the
    parent's manager, which the child's copy never reads: a forked child (``multiprocessing``'s fork
    start method, ``os.fork``) ignored SIGTERM, so ``Process.terminate()`` did not stop it and
    ``Pool.terminate()`` hung. SIGINT and SIGHUP keep the manager's handler: a Ctrl-C or a closed
    terminal reaches the whole process group, and a DataLoader worker that died of it would fail the
    training process before its preemption save (torch's workers set SIGTERM's handler themselves)."""
    handler, seen = signal.getsignal(signal.SIGTERM), set()
    while (getattr(handler, "__name__", None) == "_on_signal" and id(owner := getattr(handler, "__self__", None)) not in seen
           and isinstance(getattr(owner, "_old_handlers", None), dict) and signal.SIGTERM in owner._old_handlers):
        seen.add(id(owner))
        handler = owner._old_handlers[signal.SIGTERM]
    if seen and handler is not None:  # None: set outside Python, cannot be put back
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signal.SIGTERM, handler)


def manager_call(mgr: Any, name: str) -> bool:
    """``onethread``'s guard, before each call ``name`` (open, save, wait, restore, close) of the
    ``CheckpointManager`` ``mgr``: whether it was opened by another process, which forked this one
    (``os.fork`` in the training script: a child that leaves the ``with`` block by ``sys.exit`` or an
    exception). There ``close()`` lets go of this process's copies only (:func:`_let_go`) and this
    returns True; the other calls raise a ``CheckpointError``: the manager's lock, save in flight,
    RAM tier and event log are the parent's. Before, the child's ``close()`` waited for the parent's
    save in flight and wrote a ``save_failed`` of it into the parent's events.jsonl and raised (the
    child's ``sys.exit(0)`` exited 1); a save that had committed got its ``save`` event twice; and
    with a RAM tier the child removed the parent's RAM directory, checkpoints not yet copied to disk
    included. False (the call goes on) in the process that opened it, or when it is not open."""
    opener = mgr.__dict__.get("_pid")
    if opener is None or opener == os.getpid() or not mgr.__dict__.get("_opened"):
        return False
    if name == "close":
        _let_go(mgr)
        return True
    raise CheckpointError(
        f"CheckpointManager.{name}() in process {os.getpid()}: this manager was opened by process {opener}, which "
        "forked this one; it saves, waits and restores in that process only (its lock, its save in flight, its event "
        "log are there). Here, read a checkpoint with tg.load(path, state) (mgr.latest_step() names the newest step), "
        "or open a manager of this process's own on another directory"
    )


def _let_go(mgr: Any) -> None:
    """:func:`manager_call`'s ``close()`` in a forked child: this process's signal handlers back as
    they were before the manager's ``open()``, its copy of the lock's descriptor closed (the parent's
    lock and the file untouched), its staging memory free; nothing waited for, written or removed."""
    mgr._opened = False
    mgr.__dict__.pop("_failing", None)  # __exit__'s mark, which close() pops
    if threading.current_thread() is threading.main_thread():
        policies.unchain_handlers(mgr._on_signal, mgr._old_handlers)
    if mgr._lock is not None:
        mgr._lock.forget()
    if mgr.async_save:
        async_save.release_staging(mgr)


os.register_at_fork(after_in_child=_after_fork_in_child)

# The exit's drain of a save in flight after the threads were joined, wherever this reset is registered: the
# package's first use (trainguard/__init__.py, _boot) and code that imports deep paths only (every manager).
from .exitdrain import after_threads  # noqa: E402

after_threads()
