"""Temporary outputs beside a target outside a run directory: who writes them, and removing those of dead writers.

``trainguard export``/``convert`` to a file (``export.replacing``), ``convert --to dcp`` (``dcp_export.write_dcp``)
and ``consolidate``/``convert`` into a trainguard checkpoint on local disk (``consolidate.write_full``) write their
output under a temporary name beside the target (``.NAME.tmp-<id>``, ``NAME.tmp-<id>``) and rename it into place.
A writer killed mid-write (SIGKILL, the OOM killer, a lost node) left that temporary output for good: it never
looked valid, but it held the output's size (GBs), one more per retry. A run directory's debris is removed by its
manager under the run lock (``commit.clean_debris``); nothing looked beside these outputs.

Now each such writer holds an *owner file* ``<temp>.owner`` for as long as its temporary output exists
(:func:`owned`, created before it and removed after it): its pid, host and start time, under a POSIX record lock
as the run lock's (``runlock``: the lock goes when the process dies). It is locked and written as ``<temp>.owner.new``
and renamed into place, so no sweep ever finds it unlocked and empty while its writer lives (review58f: a sweep of
another process in that instant removed it as a dead writer's); one left by a writer killed in that instant goes
at a sweep an hour later (``_stage_left``, review58j). Before it writes, the next writer of the
same target calls :func:`sweep`, which removes the temporary outputs of that target whose writer is dead:

- the owner's lock is held by another process: a live writer (of this host, or, on a shared file system whose
  locks reach the server, e.g. NFSv4, of another): left;
- the lock is free and the record names this host and this PID namespace: dead unless its pid is alive and started
  before the record (``runlock._live_here``), then left with a warning (liveness unknown); another PID namespace of
  this host name (a container with host networking) is judged as another host (its pids mean nothing here);
- the lock is free and the record names another host: dead where the file system is local (its locks are this
  kernel's: a container with another host name); on a network file system (NFS, Lustre, CIFS, FUSE, ...) a free lock
  may be a lock that the mount keeps local: left, with a warning naming the path and how to remove it;
- no owner file (a writer of trainguard before session 58): left, with that warning.
In-process writers (another thread's, :data:`_MINE`) are never looked at: closing a descriptor of their owner
file here would drop their lock. Local paths only; an object store's temp objects are not these (``consolidate``
writes in place there, the manifest last).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterator

from . import layout

log = logging.getLogger("trainguard")
OWNER = ".owner"
STAGE = ".new"  # ``owned``: the owner file before it is locked and written (no sweep's pattern matches it)
_MINE: dict[str, int] = {}  # owner files of this process's live writers (absolute path -> descriptor): ``_mine``
_LOCK = threading.Lock()
# File systems whose locks are this kernel's: a free lock there is a dead writer's, whatever host it named.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "zfs", "f2fs", "overlay", "vfat",
                      "exfat", "ntfs3", "reiserfs", "jfs", "bcachefs", "hfsplus", "apfs", "devtmpfs"})


def temp_re(name: str) -> re.Pattern[str]:
    """The names of the temporary outputs of target ``name`` (and their owner files): ``.NAME.tmp-<id>`` (export,
    convert to a file or DCP directory), ``NAME.tmp-<id>`` (consolidate, convert into a checkpoint)."""
    return re.compile(rf"^\.?{re.escape(name)}\.tmp-[0-9a-f]{{1,32}}({re.escape(OWNER)})?\Z", re.ASCII)


@contextlib.contextmanager
def owned(tmp: str) -> Iterator[None]:
    """The writer of the temporary output ``tmp`` (``export.replacing``, ``dcp_export.write_dcp``,
    ``consolidate.write_full``; one process; rank 0 of a plain ``tg.save``, ``api.persist_and_commit``), around
    everything from before ``tmp`` is created to after it is renamed or removed: ``<tmp>.owner`` holds its pid, host
    and start under a POSIX lock, and goes at the end. Best effort, never raises: where the owner file cannot be made
    or written (a read-only or full file system, a name too long for the suffix) the writer goes on without one, and
    its own write says what is wrong (a ``DiskFullError``, the read-only file system: the callers' words); a file
    system without locks (ENOLCK) keeps the record only. A temp left without an owner file is warned about by
    :func:`sweep`, not removed."""
    owner = os.path.abspath(tmp + OWNER)
    stage = owner + STAGE  # locked and written under this name, then renamed: never seen unlocked and empty
    try:
        fd = os.open(stage, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        yield
        return
    with _LOCK:
        _MINE[owner] = fd
    try:
        with contextlib.suppress(OSError):  # ENOLCK (a mount without locks): the record still names host and pid
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(OSError):  # ENOSPC: an empty record (a free lock on a local file system still tells)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                     "pidns": _pidns()}).encode())
        try:  # review58f: created under its own name, a sweep of another process could find it in the instant
            os.rename(stage, owner)  # before its lock and record, take it for a dead writer's and remove it
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(stage)
        yield
    finally:
        for left in (owner, stage):  # stage: an interrupt (Ctrl-C) before its rename left it, matched by no sweep (review58j)
            with contextlib.suppress(OSError):
                os.unlink(left)
        with _LOCK:
            _MINE.pop(owner, None)
        os.close(fd)


def sweep(target: str) -> list[str]:
    """Before a new write of the local output ``target`` (the callers of :func:`owned`, before theirs): remove the
    temporary outputs of ``target`` beside it whose writer is dead; warn about those it cannot tell (the module's
    docstring). Returns the paths removed. Never raises: a failure to look or remove is warned about."""
    head, name = os.path.split(os.path.abspath(target.rstrip("/") or target))
    pattern = temp_re(name)
    try:
        names = os.listdir(head)
    except OSError:
        return []  # no directory (yet): nothing left there
    ours = [n for n in names if n.startswith((f"{name}.tmp-", f".{name}.tmp-", f"{name}.old-"))]  # C speed: one
    # listing of a directory of 20,000 entries per plain tg.save; the regexes below only for this target's names
    temps = sorted({n[: -len(OWNER)] if n.endswith(OWNER) else n for n in ours if pattern.match(n)})
    olds = {n.rsplit(".old-", 1)[1]: n for n in ours if layout.is_old_of(n, name)}  # an overwrite's aside, by id
    names = set(ours)  # the temps, owner files and asides of this target: what the loop below asks about
    done = [p for n in ours if n.endswith(OWNER + STAGE) and pattern.match(n[: -len(STAGE)])
            and _stage_left(p := os.path.join(head, n))]
    for t in temps:
        path = os.path.join(head, t)
        owner = path + OWNER
        if _mine(owner):
            olds.pop(t.rsplit(".tmp-", 1)[1], None)
            continue
        if t + OWNER not in names:
            if t in names and not _appeared(owner) and os.path.lexists(path):
                _unknown(path, target, ("it has no owner file: a CheckpointManager's save (its next open removes "
                                          "it), or a writer of a trainguard before session 58"))
            continue
        old = olds.pop(t.rsplit(".tmp-", 1)[1], None) if not t.startswith(".") else None
        why = _alive(owner)
        if why == "":
            try:
                _remove(path)
                if old is not None:
                    done += _settle(head, name, old)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(owner)
            except OSError as e:
                warnings.warn(f"could not remove {path}, left by a killed writer of {target}: {e}", stacklevel=3)
                continue
            if t in names:
                done.append(path)
        elif why != "live":
            _unknown(path, target, why)
    for n in olds.values():  # no owner file: a tg.save's overwrite, or an earlier trainguard's
        _unknown(os.path.join(head, n), target, "the checkpoint an overwrite set aside, with no owner file to tell "
                 "whether that writer is alive (tg.save, or a trainguard before session 58)")
    if done:
        log.warning("trainguard: removed %d temporary output(s) of %s left by killed writers: %s", len(done), target,
                    done)
    return done


def _settle(head: str, name: str, old: str) -> list[str]:
    """``sweep``, a dead writer's overwrite of ``head/name`` (``commit.commit_dir``) that set the previous checkpoint
    aside as ``old``: killed between its two renames (nothing at ``name``), it is put back; killed after (while it
    removed ``old``: its manifest first), ``old`` goes. What ``commit.clean_debris`` does in a run directory."""
    final, aside = os.path.join(head, name), os.path.join(head, old)
    if not os.path.lexists(final) and os.path.isfile(os.path.join(aside, layout.MANIFEST)):
        os.rename(aside, final)
        fd = os.open(head, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log.warning("trainguard: put back %s, which an overwrite killed before its commit had set aside as %s",
                    final, aside)
        return [f"{aside} -> {final}"]
    if os.path.isfile(os.path.join(final, layout.MANIFEST)):
        _remove(aside)
        return [aside]
    _unknown(aside, final, f"{final} holds no checkpoint to keep instead")
    return []


def _mine(owner: str) -> bool:
    """Whether ``owner`` is the owner file of a live writer of this process, by path or, through another path to
    the same directory (a symbolic link, a bind mount), by inode: opening and closing it here would drop that
    writer's POSIX lock (``runlock._held_here``)."""
    with _LOCK:
        mine = dict(_MINE)
    if owner in mine:
        return True
    try:
        st = os.stat(owner)
    except OSError:
        return False
    for fd in mine.values():
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), st):
                return True
    return False


def _appeared(owner: str) -> bool:
    """Whether the owner file exists now (a writer that created it since the listing: its temp is not unowned)."""
    return os.path.lexists(owner)


def kept_for_writer(path: str) -> bool:
    """``commitfail.removed`` (``commit.clean_debris``, rank 0 at a manager's open, local disk): whether the temp
    directory ``path`` of a run directory is a ``consolidate``/``convert`` writer's (it has an owner file) that is
    alive, or may be (warned about): left. Its run lock does not cover such a writer, which takes no lock; before,
    the open removed its directory under it. False (removed as debris) when it has no owner file or its writer is
    dead; the owner file of a dead one goes by :func:`drop_owner` after it."""
    owner = os.path.abspath(path) + OWNER
    if _mine(owner) or not os.path.lexists(owner):
        return _mine(owner)
    why = _alive(owner)
    if why and why != "live":
        _unknown(path, os.path.basename(path).rsplit(".tmp-", 1)[0], why)
    return why != ""


def drop_owner(path: str) -> None:
    """The owner file of the temp output ``path``, removed after it (``commitfail.removed``)."""
    with contextlib.suppress(OSError):
        os.unlink(path + OWNER)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _unknown(path: str, target: str, why: str) -> None:
    warnings.warn(f"{path} is a temporary output of {target} that trainguard cannot tell is a dead writer's ({why}); "
                  f"it is left. If no process is writing {target} now, remove it: rm -rf {path!r} "
                  f"{path + OWNER!r}", stacklevel=4)


def _alive(owner: str) -> str:
    """``sweep``: ``"live"`` (the owner file's lock is held by another process), ``""`` (its writer is dead), or
    why it cannot be told (the module's docstring)."""
    try:
        fd = os.open(owner, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return ""  # its writer finished meanwhile (the temp output went first)
    except OSError as e:
        return f"its owner file cannot be read: {e}"
    try:
        held = _held(fd)
        if held:
            return "live"
        try:
            rec = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            rec = {}
        host = rec.get("host") if isinstance(rec, dict) else None
        ns = rec.get("pidns") if isinstance(rec, dict) else None
        if host == socket.gethostname() and (ns is None or ns == _pidns()):  # this host's PID namespace: its pid tells
            return f"its writer, pid {rec.get('pid')} on this host, is alive but holds no lock" if _pid_alive(rec) else ""
        # review58f: a container of the same host name (host networking) has other pids: one gone here may be alive
        # there; only the lock tells (before, on a mount without locks, a live writer's temp there was removed)
        if held is False and _local_fs(owner):
            return ""  # this kernel's locks: a free one is a dead writer's, whatever host it named
        if held is None:
            where = " (in another PID namespace: a container)" if host == socket.gethostname() else ""
            return f"its writer ran on host {host or 'unknown'}{where} and this file system has no locks to tell"
        return f"its writer ran on host {host or 'unknown'} and this network file system's locks may not reach it"
    finally:
        os.close(fd)


STAGE_AGE = 3600.0  # seconds: a staged owner file older than this is a killed writer's (``owned`` renames it at once)


def _stage_left(stage: str) -> bool:
    """``sweep``: remove ``<temp>.owner.new`` where its writer was killed between creating and renaming it (``owned``:
    microseconds; its temp output was not made yet), told by its age (``STAGE_AGE``) and a lock no other process
    holds. Before (review58j), it stayed for good: no sweep's pattern matches it. True when removed."""
    try:
        fd = os.open(stage, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < STAGE_AGE or _held(fd) or _mine(stage[: -len(STAGE)]):
            return False
        os.unlink(stage)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _held(fd: int) -> bool | None:
    """Whether another process holds a lock on ``fd``'s file (``F_GETLK``: tested, not taken), None where locks
    cannot be tested (ENOLCK, not Linux)."""
    try:
        probe = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock, 64-bit Linux
        return struct.unpack("@hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0] != fcntl.F_UNLCK
    except OSError:
        return None


def _pidns() -> int | None:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), for the owner record: a pid means something
    only in its namespace. None where it cannot be told (not Linux)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _pid_alive(rec: dict[str, object]) -> bool:
    """Whether the record's pid is a live process of this host that started before the record (``runlock._started``)."""
    from .runlock import _started

    try:
        pid, since = int(rec["pid"]), float(rec["since"])  # type: ignore[call-overload, arg-type]
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except PermissionError:
        pass  # another user's process: alive
    except (OSError, ValueError, KeyError, TypeError):
        return False
    started = _started(pid)
    return started is None or started <= since + 1


def _local_fs(path: str) -> bool:
    """Whether ``path`` lies on a file system of :data:`LOCAL_FS` (``/proc/self/mountinfo``: the longest mount point
    above its real path); False where it cannot be told."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].encode().decode("unicode_escape") if "\\" in fields[4] else fields[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, right.split()[0]
    except OSError:
        return False
    return kind in LOCAL_FS
