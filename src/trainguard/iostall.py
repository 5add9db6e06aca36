"""Writes that never return. A stalled file system (a hung NFS server, a FUSE mount whose daemon
died, a failing disk, an object store that stopped answering) holds an async save's thread in one
write, fsync or rename for good. Before, the rank's next ``save()``, ``wait()`` or ``close()``
waited for that thread with no bound, with the hang watchdog paused by the save: the job hung
silently until someone killed it (the other ranks failed the save at their round's timeout and
went on, waiting for this rank in their next collective).

Who calls what: ``async_save._run`` (the save thread, every rank) and a sync save write through
:func:`watched`, which records each storage call in flight (start time, what, where) for the
process; ``SaveHandle.result_bounded`` (``CheckpointManager``'s wait for the save in flight,
training thread) raises :class:`StuckWriteError` once one call has been in flight for the
manager's ``timeout`` (``TRAINGUARD_TIMEOUT``, 600 s by default), the same bound every round of a
save has. The RAM tier's copy to the run directory (``tiers.RamTier``, rank 0) writes through
:func:`watched` too, and its wait is bounded by :func:`join_bounded`. The thread cannot be
stopped inside the kernel: it stays (a daemon, gone with the process), the save stays in flight
(no new save reuses its staging memory), and it commits if the call ever returns. A sync save's
call runs in the training thread itself: nothing there can raise; under ``trainguard run`` the
hang watchdog (``elastic/watchdog.py``) ends the worker once such a call is in flight past the
timeout and a grace. Two dict operations per call of a few MiB: nothing next to the write.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import CheckpointError

_OPEN: dict[int, tuple[float, str, int]] = {}  # call id -> (time.monotonic() at its start, what it does, its thread)
_IDS = itertools.count()  # next() is one step under the GIL


class StuckWriteError(CheckpointError):
    """A storage call of this rank's save thread has not returned for the manager's timeout.
    Raised by ``CheckpointManager.save``/``wait``/``close`` whatever ``on_error`` says: the save
    cannot end, so no later save can start on this rank. Not permanent: a restart (on a node whose
    storage answers) may well save."""


@contextlib.contextmanager
def inside(what: str) -> Iterator[None]:
    """Record one storage call in flight while the block runs (any thread)."""
    k = next(_IDS)
    _OPEN[k] = (time.monotonic(), what, threading.get_ident())
    try:
        yield
    finally:
        _OPEN.pop(k, None)


def oldest(within: str = "", thread: int | None = None) -> tuple[float, str] | None:
    """The oldest storage call in flight in this process: (seconds in it, what), or None. With
    ``within`` (a save's target path), only calls on it or on its temp or set-aside directories, and
    with ``thread`` (a save thread's ident) also any call of that thread (the retention it runs once
    committed, on other steps' directories): another thread's save, or the RAM tier's copy, is not
    this save's stuck write."""
    calls = list(_OPEN.values())  # a copy in one step: other threads add and remove meanwhile
    if within or thread is not None:
        calls = [c for c in calls if c[2] == thread
                 or within and any(within + sep in c[1] or c[1].endswith(within) for sep in ("/", ".tmp-", ".old-"))]
    if not calls:
        return None
    t, what, _thread = min(calls)
    return time.monotonic() - t, what


class _Writer:
    """One open file of ``storage.open_write``: its writes and its final fsync recorded."""

    def __init__(self, w: Any, path: str) -> None:
        self._w, self._path = w, path

    def __getattr__(self, name: str) -> Any:  # abort, direct_bytes, ... as the writer's own; reserve is optional
        got = getattr(self._w, name)
        if name != "reserve":
            return got

        def reserve(size: int) -> None:
            with inside(f"reserving {size} bytes for {self._path}"):
                got(size)

        return reserve

    def pwrite(self, data: Any, offset: int) -> None:
        with inside(f"a write of {len(data)} bytes at offset {offset} of {self._path}"):
            self._w.pwrite(data, offset)

    def finish(self, size: int) -> None:
        with inside(f"the fsync (or upload completion) of {self._path}"):
            self._w.finish(size)


class _Storage:
    """``storage`` with the calls of a save that write, list or remove (``watched``); anything else is its own."""

    def __init__(self, storage: Any) -> None:
        self._s = storage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def open_write(self, path: str, **kw: Any) -> _Writer:
        with inside(f"creating {path}"):
            return _Writer(self._s.open_write(path, **kw), path)

    def write_atomic(self, path: str, data: bytes) -> None:
        with inside(f"writing {path}"):
            self._s.write_atomic(path, data)

    def listdir(self, path: str) -> list[str]:
        with inside(f"listing {path}"):
            return self._s.listdir(path)

    def exists(self, path: str) -> bool:
        with inside(f"looking up {path}"):
            return self._s.exists(path)

    def remove_tree(self, path: str) -> None:
        with inside(f"removing {path}"):
            self._s.remove_tree(path)

    def makedirs(self, path: str) -> None:
        with inside(f"creating directory {path}"):
            self._s.makedirs(path)

    def rename_dir(self, src: str, dst: str) -> None:
        with inside(f"renaming {src} to {dst}"):
            self._s.rename_dir(src, dst)

    def fsync_dir(self, path: str) -> None:
        with inside(f"the fsync of directory {path}"):
            self._s.fsync_dir(path)


def watched(storage: Any) -> Any:
    """``async_save._run`` and ``tiers.RamTier.persist`` (their threads), ``api.start_save``'s sync
    save (the caller's thread: ``elastic.watchdog`` ends a save stuck there): ``storage`` whose
    writing, listing and removing calls are recorded while in flight."""
    return _Storage(storage)


def join_bounded(thread: threading.Thread, limit: float, what: str, within: str = "") -> None:
    """``tiers.RamTier.wait`` (rank 0: the next copy to disk, ``restore``, ``close``): join the RAM
    tier's copy thread; a storage call of it in flight for ``limit`` seconds raises
    ``StuckWriteError`` (the thread stays, a daemon, and the caller's ``_thread`` with it)."""
    while thread.is_alive():
        thread.join(min(limit / 4, 5.0))
        late = oldest(within, thread.ident)
        if thread.is_alive() and late is not None and late[0] >= limit:
            raise StuckWriteError(
                f"{what} has been stuck for {late[0]:.0f} s in {late[1]} (the limit is the manager's timeout, "
                f"{limit:g} s): {_WHY}"
            )


_WHY = ("the storage does not answer (a hung NFS server, a FUSE mount whose daemon died, a failing disk?). Check the "
        "storage of this node; a restart elsewhere resumes from the newest committed checkpoint. Raise `timeout=` (or "
        "TRAINGUARD_TIMEOUT) if single writes there are slow")


# What ``retention.apply_retention`` records while it runs (on the save thread of an async save, once committed).
RETENTION = "the retention after step"


def stuck_error(step: int | None, rank: int, seconds: float, what: str, timeout: float) -> StuckWriteError:
    after = ("The checkpoint of that step is committed; no other save can start on this rank until the call returns"
             if what.startswith(RETENTION) else
             "The save stays in flight and commits if the call returns; no other save can start on this rank meanwhile")
    return StuckWriteError(
        f"rank {rank}: the save of step {step} has been stuck for {seconds:.0f} s in {what} (the limit is the "
        f"manager's timeout, {timeout:g} s). {after}. Cause: {_WHY}"
    )
