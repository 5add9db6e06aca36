"""The error of a local write that ran out of space (``local._LocalWriter``, ``LocalStorage.write_atomic``),
or that this user may not make (:func:`write_refused`)."""

from __future__ import annotations

import errno
import os
import shutil

from ..errors import CheckpointError, DiskFullError, error_text


def disk_error(e: OSError, path: str, needed: int) -> OSError:
    """``e`` as a ``DiskFullError`` saying how much was needed and is free, when it is one (ENOSPC,
    EDQUOT; EFBIG: a file-size limit); otherwise ``e``, with ``path`` when it names no file. Called on
    the rank whose write failed. ``needed`` 0: the fsync failed (NFS reports a lack of space there)."""
    here = f"{needed} more bytes were needed here" if needed else "the file system reported it at the fsync of the bytes written"
    if e.errno == errno.EFBIG:  # not space: a size limit
        return DiskFullError(
            e.errno,
            f"file too large writing {path}: {here}, past this process's file-size limit "
            "(ulimit -f, RLIMIT_FSIZE) or the file system's largest file. Raise the limit, or save elsewhere",
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(os.path.dirname(path)).free} bytes are free"
        except OSError:  # the directory removed meanwhile: its FileNotFoundError replaced the ENOSPC
            free = "the free space could not be read"
        return DiskFullError(
            e.errno,
            f"no space left writing {path}: {here}, "
            f"{free}. Free space, lower retention (keep=...), or save elsewhere",
        )
    if e.filename is None:  # os.pwrite/os.fsync errors name no file: say which
        return OSError(e.errno, e.strerror, path)
    return e


def progress(written: int) -> int:
    """``written``, the count a write returned, when it wrote something: a write that returns 0 (some
    FUSE file systems) made the write loops of ``local.py`` spin for good."""
    if written == 0:
        raise OSError(errno.EIO, "the file system accepted no byte of a write (it returned 0)")
    return written


def save_failed(e: BaseException, target: str) -> BaseException:
    """``api.persist_and_commit``, one process: the error a failed save raises for ``e``, its
    cause. A ``CheckpointError`` (a ``DiskFullError`` of a write) is itself; ENOSPC or EDQUOT
    elsewhere (creating the temp directory or a file: a file system out of inodes, or full between
    two writes) becomes a ``DiskFullError`` too, as docs/reliability.md promises."""
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        # No file named (an fsspec file object's write: local://, a FUSE-backed store; a directory's fsync): it said "creating None"
        at = f"creating {e.filename}" if e.filename is not None else "writing its files"
        err: CheckpointError = DiskFullError(
            e.errno, f"save of {target} failed: no space left on device {at}: the file system is out "
            "of space or of inodes (`df -h`, `df -i`). Free some, lower retention (keep=...), or save elsewhere")
    elif (refused := write_refused(e)) is not None:
        err = CheckpointError(f"save of {target} failed: {refused}")
    else:
        err = CheckpointError(f"save of {target} failed: {error_text(e)}")  # an object store's: what to check
    err.__cause__ = e
    return err


def write_refused(e: BaseException) -> str | None:
    """What a local ``PermissionError`` or EROFS of a write (``e``: creating the save's temporary directory or a
    file in it) tells the user, or ``None`` for any other error (an object store's 403, marked
    ``remote``, has its own words: ``errors.store_refused``). ``save_failed`` (``tg.save``, ``convert``'s
    import) and ``consolidate``: it was "PermissionError: [Errno 13] Permission denied: 'DST.tmp-<id>'",
    a temporary name and nothing to change."""
    if not isinstance(e, OSError) or getattr(e, "remote", False):
        return None
    where = os.path.dirname(os.fspath(e.filename)) if e.filename is not None else "the destination's directory"
    if e.errno == errno.EROFS:  # said "OSError: [Errno 30] Read-only file system: 'DST.tmp-<id>'" (hunt58 tmp58)
        return (f"{where} is on a read-only file system: write to a directory on a writable one (or remount it "
                "read-write)")
    if not isinstance(e, PermissionError):
        return None
    return (f"this user may not write in {where} ({e.strerror or e}): save to a directory you may write to, "
            "or give this user write access to it")
