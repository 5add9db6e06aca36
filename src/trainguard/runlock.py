"""The run directory's writer lock (``CheckpointManager.open``/``close`` on rank 0)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import struct
import sys
import time
import warnings
import weakref
from typing import Any

from . import layout, stopwait
from .errors import CheckpointError, LockedError
from .permanent import mark
from .userframe import user_stacklevel

_HELD: set[str] = set()  # lock paths held by this process (POSIX locks do not conflict within one)
_OWNED: dict[str, RunLock] = {}  # run directory (absolute, and resolved) -> its lock held here: check_owned
log = logging.getLogger("trainguard")
LOST = "is no longer locked by this job"  # in lock_lost's error, on every rank (the rounds carry its text): manager.py


class RunLock:
    """One writing job per run directory: ``<root>/.lock`` under a POSIX record lock.

    POSIX locks belong to the process: they vanish when it dies (so a crashed job's lock is
    stale and is taken over with a warning) and are not inherited by forked DataLoader workers.
    Object stores have no locks; there the lock is skipped (documented in docs/storage.md).
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, layout.LOCK)
        self.fd: int | None = None
        self._real = ""  # the lock file's real path while held (release does not resolve it again)
        self._info = b""  # the holder record this process wrote: another job's, or none, there later (_taken)
        self._also = b""  # the record mark_stopping writes, accepted while it replaces _info
        self.gone: weakref.finalize | None = None  # release_when_gone's: one per lock, however often its manager opens

    def acquire(self, wait: float = 0.0) -> None:
        """``CheckpointManager.open``, rank 0. ``wait``: how long to wait for a holder whose record says it is
        stopping (``mark_stopping``: an old incarnation finishing its last save), at most."""
        real = os.path.realpath(self.path)
        # _held_here: the same directory through another path (a bind mount, a second mount of the same NFS
        # export) resolves elsewhere; POSIX locks of one process do not conflict, so lockf took it again
        # and each manager's retention deleted the other's checkpoints. Checked by inode, without opening.
        if real in _HELD or _held_here(self.path):
            via = "" if real in _HELD else " (the same directory, through another path: a bind mount or a second mount)"
            raise mark(LockedError(
                f"{os.path.dirname(self.path)} is already used by another CheckpointManager in this "
                f"process{via}; close it first or give each manager its own directory (a manager opened without "
                "`with` whose variable is gone, in a notebook: `import gc; [m.close() for m in gc.get_objects() "
                "if isinstance(m, trainguard.CheckpointManager)]`)"
            ))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:  # any failure (an I/O error, Ctrl-C) closes the descriptor, and the lock goes with it
            self._take(fd, wait)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self._real = fd, real
        _HELD.add(real)
        for key in {os.path.abspath(os.path.dirname(self.path)), os.path.dirname(real)}:
            _OWNED[key] = self

    def _take(self, fd: int, wait: float = 0.0) -> None:
        """``acquire``: lock ``fd`` and write this process as the holder (the caller closes ``fd`` on error)."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # not held by another job: the lock failed (ENOLCK, EIO)
                raise
            if not ((w := stopwait.budget(fd, wait)) > 0 and stopwait.wait_free(fd, w, os.path.dirname(self.path), _read_holder)):
                raise _locked_error(fd, os.path.dirname(self.path), wait) from None
        old = _read_holder(fd)
        if old and f"pid {os.getpid()} " not in old + " ":
            if _earlier_attempt(fd):  # torchrun's agent restarted this job's workers: expected, not a warning
                log.info("trainguard: taking over the lock on %s from this job's previous attempt (%s)",
                         os.path.dirname(self.path), old)
            else:
                warnings.warn(_taken_over(os.path.dirname(self.path), old, fd), stacklevel=user_stacklevel())
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), **_attempt(), **stopwait.who()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        os.fsync(fd)
        self._info = info

    def release(self) -> None:
        """Never raises: the holder info is advisory, and closing the descriptor releases the lock."""
        fd = self._unrecord()
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                # Still this process's (taken again if lost, lock_lost): a job that took it since, or the
                # parent of a forked child calling close(), keeps its holder info (the file is shared).
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, 0)
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget(self) -> None:
        """``forks.manager_call``, in a child forked while the manager was open (its ``close()``): close
        this process's copy of the descriptor and forget the lock here. The child holds no lock (POSIX
        locks are not inherited) and leaves the file alone: the parent's lock and holder info stay."""
        fd = self._unrecord()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unrecord(self) -> int | None:
        """``release``/``forget``: the descriptor (None when not held), taken out of this process's records."""
        fd, self.fd = self.fd, None
        if fd is None:
            return None
        _HELD.discard(self._real)
        for key, held in list(_OWNED.items()):  # list(): one step under the GIL (another thread's manager)
            if held is self:
                _OWNED.pop(key, None)
        return fd


def release_when_gone(owner: object, lock: RunLock) -> None:
    """``CheckpointManager.open``, rank 0, once it holds ``lock``: a manager dropped without ``close()``
    (a notebook cell that reassigned its variable, ``handle_signals=False``) releases the lock when it
    is collected, with a ResourceWarning. Before, the lock stayed held in this process for good: every
    later manager of that directory got LockedError, and no manager was left to close. Not at exit:
    the process's end releases it. Once per lock: a manager opened again after ``close()`` (the same
    object in another ``with`` block) registered one more finalizer at every open, each kept until the
    manager was collected (``tests/test_hunt48_soak.py``)."""
    if lock.gone is None or not lock.gone.alive:
        lock.gone = weakref.finalize(owner, _release_dropped, lock)
        lock.gone.atexit = False


def _release_dropped(lock: RunLock) -> None:
    if lock.fd is not None:  # not closed
        warnings.warn(f"a CheckpointManager of {os.path.dirname(lock.path)} was garbage-collected without "
                      "close(): its lock is released (use `with CheckpointManager(...) as mgr:`)", ResourceWarning,
                      stacklevel=2)
        lock.release()


def check_owned(parent: str) -> None:
    """``commit.commit_dir`` and ``tiers.RamTier.persist``, on rank 0, right before the manifest is
    written (the commit), and ``commitfail`` after a failed one (to name the cause): when this
    process holds the lock of ``parent`` (the run directory the checkpoint goes into), raise
    :func:`lock_lost`'s error if the lock was lost since the save started. An async save commits
    long after ``save()`` returned (its lock was checked then): an ``rm -rf`` of the run directory
    meanwhile was recreated by the save's ``makedirs`` and the commit landed there, unlocked.
    Raised here, the save fails (its temp directory is removed) and the error reaches the other
    ranks in the save's own "commit" round. A stat and a lockf per commit."""
    if not _OWNED:
        return
    err = lock_lost(_OWNED.get(os.path.abspath(parent)) or _OWNED.get(os.path.realpath(parent)))
    if err is not None:
        raise err


def holder_of(root: str) -> str | None:
    """Who holds ``root``'s run lock now (the holder it recorded), or None: no lock file, no live
    holder, or no way to tell (not Linux). ``commitfail.unsafe_target``, before a plain ``tg.save``
    into a step directory of a run. ``F_GETLK`` tests without taking the lock (a shared lock taken
    to test would make a manager starting then fail as "in use by another job"); a lock of this
    process is known from ``_HELD`` without opening the file (closing any descriptor of it would
    drop this process's lock)."""
    path = os.path.join(root, layout.LOCK)
    if os.path.realpath(path) in _HELD or _held_here(path):
        return f"pid {os.getpid()}: a CheckpointManager of this process"
    if sys.platform != "linux":
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait for a writer
    except OSError:
        return None
    try:
        probe = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock, 64-bit Linux
        held = struct.unpack("@hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0] != fcntl.F_UNLCK
        return (_read_holder(fd) or "unknown holder") if held else None
    except OSError:  # a file system without locks (ENOLCK): nothing to tell
        return None
    finally:
        os.close(fd)


def _held_here(path: str) -> bool:
    """``holder_of``: whether ``path`` is the file of a lock this process holds, by its inode: the same
    run directory through another path (a bind mount, a second mount of the same NFS export) resolves to
    another real path, and opening and closing the file there dropped this process's lock (c64c550)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    for lock in list(_OWNED.values()):  # list(): another thread's manager may open or close meanwhile
        fd = lock.fd
        with contextlib.suppress(OSError):
            if fd is not None and os.path.samestat(os.fstat(fd), st):
                return True
    return False


def lock_lost(lock: RunLock | None) -> CheckpointError | None:
    """``CheckpointManager._save_now``, every rank, before each save: on the rank holding the lock
    (rank 0), the error when ``<root>/.lock`` is no longer the file it locked: removed (``rm -rf``
    of the run directory, which the save would silently recreate unlocked) or replaced by another
    file (that a second job may hold). Raised in the save's first round (``preflight``), so every
    rank fails before a byte is written and the committed checkpoints stay as they are; checked
    again at the commit (:func:`check_owned`). None where nothing is held here (other ranks, object
    stores) or the lock is in place: a stat and a lockf per save. Permanent (not a medium's error
    on the stat): ``trainguard run`` restarted the job into a fresh lock (after an ``rm -rf``: a
    silent fresh start from step 0); it now stops."""
    if lock is None or lock.fd is None:
        return None
    try:
        held = os.fstat(lock.fd)
    except OSError:
        return None  # the descriptor itself failed: nothing known about the path; release() reports nothing either
    try:
        now = os.stat(lock.path)
        same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        what = None if same else "was replaced by another file while this job held it"
    except FileNotFoundError:
        what = "was removed while this job held it (the run directory deleted or moved?)"
    except OSError as e:  # a medium's error (EIO, ESTALE): not permanent
        what = f"cannot be checked ({type(e).__name__}: {e})"
    if what is None:
        what = _taken(lock)
    if what is None:
        return None
    root = os.path.dirname(lock.path)
    err = CheckpointError(
        f"the run directory's lock {lock.path} {what}: {root} {LOST}, and another job could open it as a writer "
        "and delete this job's checkpoints. Nothing was saved.\nStop this job and find out what removed it (a deleted run directory took its checkpoints "
        "along: a job started there again begins at step 0); make sure no other job writes to that directory, "
        "then start the job again (it takes the lock again), or point it at another directory; `trainguard "
        "run` does not restart it (exit 78)"
    )
    return err if what.startswith("cannot") else mark(err)


_HOW = ("(closing any descriptor of that file in this process releases it: a shutil.copytree, tar or checksum "
        "of the run directory from the training script?)")


def _taken(lock: RunLock) -> str | None:
    """``lock_lost``, the lock file in place: None while this process holds its lock, else how it
    lost it. A POSIX lock goes when *any* descriptor of the file closes in the holding process: a
    ``shutil.copytree``, ``tar`` or checksum of the run directory from the training script released
    it, and a second job opened the directory as a writer. Free now: this process takes it again
    here (one fcntl and one pread per check), unless the holder record is no longer the one it
    wrote: another job held the lock meanwhile (its retention may have deleted checkpoints) and
    ended (its ``release`` emptied the record) or died (its record is there)."""
    fd = lock.fd
    assert fd is not None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            return None  # ENOLCK, EIO: nothing known (acquire raised it; here the lock may well be held)
        return (f"was locked by another job ({_read_holder(fd) or 'unknown holder'}) after this process lost its "
                f"lock on it {_HOW}")
    try:
        now = os.pread(fd, 4096, 0)
    except OSError:
        return None  # the medium's error: nothing known
    if now == lock._info or (lock._also and now == lock._also) or not lock._info:  # _also: mark_stopping's record, being written
        return None
    return (f"was held by another job meanwhile ({_read_holder(fd) or 'it ended and released it'}) after this "
            f"process lost its lock on it {_HOW}")


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        if not raw:
            return ""
        d = json.loads(raw)
        return f"pid {d.get('pid')} on {d.get('host')} since {time.ctime(d.get('since', 0))}{stopwait.describe(d)}"
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):  # time.ctime(1e300): review58j
        return "unknown holder"


def _locked_error(fd: int, root: str, wait: float) -> LockedError:
    """``_take``'s error: the lock is held by another job, named by its holder record."""
    age = stopwait.stale(fd, wait)
    if age is None and stopwait.since(fd) is not None:  # still finishing its last save after ``wait``: a later start takes it (not permanent)
        return LockedError(
            f"{root} is in use by another job ({_read_holder(fd)}), which got a stop signal and is still finishing "
            f"its last save after {wait:.0f} s: an earlier incarnation of this job (preempted, requeued)? Let it "
            "finish (killing it loses that save) and start this job again, or point this one at another directory")
    locked = LockedError(
        f"{root} is in use by another job ({_read_holder(fd)}), which got a stop signal {age:.0f} s ago and still holds "
        f"the lock, longer than this manager's timeout ({2 * wait:.0f} s): a job that goes on after its stop signal (a "
        "loop that does not check mgr.should_stop, a notebook interrupted and resumed) or stuck in its last save. Stop "
        "that job, or point this one at another directory") if age is not None else LockedError(
        f"{root} is in use by another job ({_read_holder(fd)}). Stop that job, or point this one at another "
        "directory (a launch script copied from another run's?); two writers would delete each other's checkpoints. "
        "If it is an earlier incarnation of this job, wait for it to exit: a job stopping on SIGTERM holds the lock "
        "until its last save is written"
    )
    # Permanent only when the holder is a live process of this host: a lost node's lock on a
    # shared file system may linger (an NFS lease) and go; a restart may then take it.
    return mark(locked) if _live_here(fd) else locked


def mark_stopping(lock: RunLock | None, signum: int) -> None:
    """``stops.note_stop`` on the rank holding the lock (rank 0), once, when a stop signal makes the job save
    and stop: the holder record says so, and a new incarnation started meanwhile (a requeue) waits for this
    one's last save instead of failing (``_take``). Never raises: the record is advisory."""
    if lock is None or lock.fd is None or not lock._info:
        return
    with contextlib.suppress(OSError, ValueError, TypeError):
        if os.pread(lock.fd, len(lock._info) + 1, 0) != lock._info:  # another job's record (the lock lost, _taken): not ours to mark
            return
        info = json.dumps({**json.loads(lock._info), "stopping": time.time(), "signal": int(signum)}).encode()
        lock._also = info  # first: a commit's check (_taken, on the save thread) may read it meanwhile
        os.pwrite(lock.fd, info, 0)  # longer than the record it replaces, which it starts like: no truncation
        lock._info = info


def _taken_over(root: str, old: str, fd: int) -> str:
    """``acquire``'s warning on taking over a lock that names another process. A holder alive on
    this host that does not hold this file locks another one: a ``cp -r`` of a live run copied it."""
    if not _live_here(fd):
        return f"taking over a stale lock on {root} left by {old}"
    return (f"taking over the lock on {root}: it names {old}, which is alive but does not hold this file: a copy "
            "of a live run directory (cp -r) holds a copy of its lock; or that process lost its lock (POSIX locks go "
            "when the process closes any descriptor of the file, e.g. by copying the directory). Make sure it does not "
            "write to this directory: if it is a manager, its next save refuses to")


def _attempt() -> dict[str, Any]:
    """This process's elastic attempt (under torchrun's agent): the rendezvous id and the restart count."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    try:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
    except ValueError:
        return {}
    return {"run": run, "restart": restart} if run and run != "none" else {}


def _earlier_attempt(fd: int) -> bool:
    """Whether the stale lock's holder was an earlier attempt of this job: the same rendezvous id and
    a lower restart count (the agent restarted the workers after a failure, which left the lock).
    A requeued job (a new agent: its count starts at 0 again) or another job is warned about; not one
    requeued under the same ``--rdzv-id`` whose attempt 0 failed before it took the lock (review47b)."""
    now = _attempt()
    if not now or _live_here(fd):
        return False
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        return d.get("run") == now["run"] and isinstance(d.get("restart"), int) and d["restart"] < now["restart"]
    except (OSError, ValueError, AttributeError):
        return False


def _live_here(fd: int) -> bool:
    """Whether the lock's recorded holder is a live process on this host (``acquire``'s LockedError):
    its pid exists and (where /proc tells) started before it took the lock. A pid that started
    later is another process: a pod restarted under the same host name whose old lock lingers on
    a shared file system (pid 1, or this very pid, exists there too)."""
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        pid, since = int(d["pid"]), float(d["since"])
        if d.get("host") != socket.gethostname() or pid <= 0:
            return False
        with contextlib.suppress(PermissionError):  # another user's process: /proc still tells its start
            os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    started = _started(pid)
    return started is None or started <= since + 1


def _started(pid: int) -> float | None:
    """The start time of ``pid`` (seconds since the epoch) from /proc, None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None
