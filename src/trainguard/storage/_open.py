"""Opening a checkpoint file for reading (``storage.local``): regular files only, and no
descriptor left open when a call after the ``open`` fails (an fstat's EIO, ESTALE on NFS)."""

from __future__ import annotations

import errno
import os
import stat

from ..errors import CorruptCheckpointError


def _fstat_or_close(fd: int) -> os.stat_result:
    """``os.fstat(fd)``; ``fd`` is closed when it fails (the caller then holds no descriptor to close)."""
    try:
        return os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str) -> int:
    """Open a checkpoint file for reading, refusing anything but a regular file in place.

    O_NOFOLLOW: a symlink (possibly leaving the directory) is refused. O_NONBLOCK: a FIFO
    planted under a checkpoint name cannot block the open; it is then refused as not regular.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ENOENT:
            what = "index file" if path.endswith(".idx") else "data file"  # a rank's index: not "data file" (review57c)
            raise CorruptCheckpointError(f"{path}: {what} is missing", file=os.path.basename(path)) from None
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{path} is a symbolic link; checkpoint files must be regular files inside the checkpoint",
                file=os.path.basename(path),
            ) from None
        raise
    if not stat.S_ISREG(_fstat_or_close(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", file=os.path.basename(path))
    return fd
