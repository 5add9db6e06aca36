"""Local (and POSIX shared) filesystems: pwrite/preadv on file descriptors, fsync of files and
directories, atomic renames. The default backend."""

from __future__ import annotations

import errno
import os
import shutil
import stat

from ..errors import DiskFullError
from . import _pagecache

READ_PIECE = 4 << 20  # bytes per read call of a hot load: fits the L3 cache twice over (2 streams)
# Files mostly not in the page cache: each read op in one call, verified after (as before
# pieces existed): smaller reads measured no better cold and often worse (storage._pagecache).
COLD_READ_PIECE: int | None = None


class _LocalWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)

    def pwrite(self, data: memoryview, offset: int) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done = 0
        n = len(view)
        while done < n:
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                raise _disk_error(e, self.path, n - done) from e

    def finish(self, size: int) -> None:
        try:
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)
        except OSError as e:
            raise _disk_error(e, self.path, 0) from e
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _disk_error(e: OSError, path: str, needed: int) -> OSError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = shutil.disk_usage(os.path.dirname(path)).free
        return DiskFullError(
            e.errno,
            f"no space left writing {path}: {needed} more bytes were needed here, "
            f"{free} bytes are free. Free space, lower retention (keep=...), or save elsewhere",
        )
    return e


def _open_regular(path: str) -> int:
    """Open a checkpoint file for reading, refusing anything but a regular file in place.

    O_NOFOLLOW: a symlink (possibly leaving the directory) is refused. O_NONBLOCK: a FIFO
    planted under a checkpoint name cannot block the open; it is then refused as not regular.
    """
    from ..errors import CorruptCheckpointError

    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{path} is a symbolic link; checkpoint files must be regular files inside the checkpoint",
                file=os.path.basename(path),
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", file=os.path.basename(path))
    return fd


class _LocalReader:
    #: ``io.read_targets`` reads at most this many bytes per call (block-aligned pieces,
    #: checksummed right after they are read, while still in cache); set per file at open:
    #: ``COLD_READ_PIECE`` when less than 90% of it is in the page cache (see ``_pagecache``).
    piece_bytes: int | None = READ_PIECE

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = _open_regular(path)
        cached = _pagecache.cached_fraction(self.fd)
        if cached is not None and cached < 0.9:
            self.piece_bytes = COLD_READ_PIECE

    def readinto(self, buf: memoryview, offset: int) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        done, n = 0, len(view)
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                from ..errors import CorruptCheckpointError

                raise CorruptCheckpointError(
                    f"{self.path}: truncated: wanted {n} bytes at offset {offset}, file ended after {done}",
                    file=os.path.basename(self.path),
                )
            done += got

    def close(self) -> None:
        os.close(self.fd)


class LocalStorage:
    atomic_rename = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.stat(path, follow_symlinks=False).st_size

    def read_bytes(self, path: str, limit: int) -> bytes:
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as f:
            # Never ask for more than the file holds: read(n) allocates n bytes up front.
            return f.read(min(os.fstat(fd).st_size, limit) + 1)

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            os.unlink(tmp)
            raise _disk_error(e, path, len(data)) from e
        os.close(fd)
        os.replace(tmp, path)
        self.fsync_dir(os.path.dirname(path))

    def rename_dir(self, src: str, dst: str) -> None:
        if os.path.exists(dst):
            raise FileExistsError(errno.EEXIST, "exists", dst)
        os.rename(src, dst)
        self.fsync_dir(os.path.dirname(dst))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def open_write(self, path: str) -> _LocalWriter:
        return _LocalWriter(path)

    def open_read(self, path: str) -> _LocalReader:
        return _LocalReader(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
