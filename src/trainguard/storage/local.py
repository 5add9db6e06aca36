"""Local (and POSIX shared) filesystems: pwrite/preadv on file descriptors, fsync of files and
directories, atomic renames. The default backend. ``LocalStorage``'s directory and metadata
operations are inherited from ``localdirs._LocalDirs``."""

from __future__ import annotations

import contextlib
import errno
import os
import threading

from . import _fallocate, _pagecache
from ._direct import (  # noqa: F401  (page_phase and DIRECT_ALIGN are imported from here by others)
    DIRECT_ALIGN,
    DIRECT_MIN,
    bounce_get,
    bounce_put,
    buffer_address,
    direct_io_enabled,
    direct_split,
    page_phase,
)
from ._diskfull import disk_error as _disk_error
from ._diskfull import progress as _progress
from ._open import open_regular as _open_regular
from .localdirs import _LocalDirs

READ_PIECE = 4 << 20  # bytes per read call of a hot load: fits the L3 cache twice over (2 streams)
# Files mostly not in the page cache, read buffered (no O_DIRECT here): each read op in one
# call, verified after: smaller buffered reads measured no better cold and often worse.
COLD_READ_PIECE: int | None = None
# ... and read with O_DIRECT (the default where the filesystem takes it): pieces of this size,
# whole pages straight from the device into the destination tensor. Measured on this VM (two
# 1.5 GB files written direct, after drop_caches, 2 threads): 1.10 s in 64 MiB O_DIRECT reads,
# 1.24-1.35 s buffered, 1.7-1.9 s buffered one file per thread, and 3.2 s buffered when the
# page cache had to take fresh memory from the VM first.
COLD_DIRECT_PIECE = 32 << 20
# A hot load reads each 4 MiB checksum block in reads of this size and hashes each right after
# it (streaming xxh3), while it is in the core's L2 cache, instead of hashing the whole block
# after reading it. Measured on this VM: bare preadv + xxh3 of 3.1 GB from the page cache,
# 2 threads, medians of 5: no hash 0.203 s, hash per 4 MiB block 0.234 s, 1 MiB reads
# 0.219 s, 256 KiB 0.211 s; whole hot tg.load of the 3.1 GB state, 8 alternating rounds
# (python -m bench.hot_ab): 512 KiB median 0.232 s vs 0.247 s hashing per block (two earlier
# A/Bs: 0.242/0.282 vs 0.262/0.285 s); 256 KiB gained less (the Python per read).
HASH_SUB = 512 << 10

_LOCK = threading.Lock()


class _LocalWriter:
    """Writes one data file: ``pwrite`` (from several threads), then ``finish`` or ``abort``.

    ``direct=True`` (io.write_batches asks for it): a write whose memory address and file
    offset agree modulo ``DIRECT_ALIGN`` sends its whole aligned pages through a second,
    O_DIRECT descriptor. Falls back to buffered writes, for good, when the filesystem refuses
    O_DIRECT (some FUSE filesystems and tmpfs before Linux 6.6 answer EINVAL at open; some
    devices refuse the first write). The O_DIRECT descriptor stays open until ``finish``/
    ``abort`` even then: other threads may be writing through it, and a closed number can be
    reused by the next ``open``.
    """

    def __init__(self, path: str, *, direct: bool = False) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.dfd: int | None = None
        if direct and direct_io_enabled():
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self.dfd = None
            except BaseException:  # Ctrl-C: no caller holds this writer to abort it
                os.close(self.fd)
                raise
        self.direct_ok = self.dfd is not None
        self.direct_bytes = 0  # bytes that went through O_DIRECT (tests and benchmarks read it)

    def reserve(self, size: int) -> None:
        """Allocate the file's ``size`` bytes up front (called once, before the writes, by
        ``io.write_batches``), when writing direct: O_DIRECT writes allocate extent by extent
        as they come (3 GB in two files written in parallel: ~145 extents per file, against 12
        with delayed allocation), which makes the cold read of the file slower. A full disk is
        found here; a filesystem without fallocate is skipped (no glibc emulation: _fallocate.py)."""
        if not self.direct_ok or size <= 0:
            return
        try:
            _fallocate.allocate(self.fd, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise _disk_error(e, self.path, size) from e
            # EOPNOTSUPP/EINVAL: no preallocation here; the writes allocate as they go.

    def pwrite(self, data: memoryview, offset: int) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if self.direct_ok and len(view) >= DIRECT_MIN and direct_split(view, offset, self._direct, self._buffered):
            return
        self._buffered(view, offset)

    def _buffered(self, view: memoryview, offset: int) -> None:
        done, n = 0, len(view)
        while done < n:
            try:
                done += _progress(os.pwrite(self.fd, view[done:], offset + done))
            except OSError as e:
                raise _disk_error(e, self.path, n - done) from e

    def _direct(self, view: memoryview, offset: int) -> bool:
        """Write aligned pages with O_DIRECT; False (nothing written) if the kernel refuses."""
        done, n = 0, len(view)
        while done < n:
            try:
                got = _progress(os.pwrite(self.dfd, view[done:], offset + done))  # type: ignore[arg-type]
            except OSError as e:
                if e.errno == errno.EINVAL and done == 0:
                    self.direct_ok = False  # refused (alignment rules of this device): buffered from now on
                    return False
                raise _disk_error(e, self.path, n - done) from e
            if got % DIRECT_ALIGN:  # a short write off the grid: finish buffered
                self._buffered(view[done + got :], offset + done + got)
                got = n - done
            done += got
        with _LOCK:
            self.direct_bytes += n
        return True

    def _close_direct(self) -> None:
        if self.dfd is not None:
            try:
                os.close(self.dfd)
            except OSError:
                pass
            self.dfd = None

    def finish(self, size: int) -> None:
        try:
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)  # direct writes are on the device; fsync also makes their metadata durable
            if self.direct_bytes * 10 >= size * 9 > 0:
                _drop_cached(self.fd)
        except OSError as e:
            raise _disk_error(e, self.path, 0) from e
        finally:
            self._close_direct()
            self._close()

    def abort(self) -> None:
        self._close_direct()
        self._close()

    def _close(self) -> None:
        """Once: ``abort`` follows a failed ``finish``; a number closed twice may be another thread's file by then."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _drop_cached(fd: int) -> None:
    """Drop what a mostly-direct write left in the page cache (the pages around each chunk's
    direct pages, written buffered; clean after the fsync; ~0.4 ms a file). Called by
    ``finish`` when at least 90% of the file went direct: such a file is read cold anyway (under
    90% cached). Left there, those scattered pages made the page cache that a later read of the
    file fills costlier to load from: the 1 GB GPT + AdamW state read once, then loaded in place,
    9 rounds interleaved in one process (session 22): CPU per load
    0.286 s with the pages left, 0.242 s dropped (0.76-0.91x round by round). Advice only."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _LocalReader:
    """Reads one data file for ``io.read_targets`` (several threads call ``readinto``).

    Its read size is chosen per file at open (``piece_bytes``, see ``_pagecache``): at least
    90% of the file in the page cache, ``READ_PIECE`` buffered pieces, each checksummed right
    after it is read, while still in the CPU caches. Less (a cold load): a second, O_DIRECT
    descriptor reads ``COLD_DIRECT_PIECE`` pieces whose whole pages go from the device straight
    into the destination when its address agrees with the file offset modulo a page (the save
    placed large chunks at their memory's page phase; ``io`` aligns scratch buffers alike), or
    else through a page-aligned bounce buffer and one copy; the bytes around those pages, reads
    under ``DIRECT_MIN``, and everything when O_DIRECT is refused (EINVAL at open or at the
    first read) or off (``TRAINGUARD_DIRECT_IO=0``), are read buffered.
    """

    piece_bytes: int | None = READ_PIECE
    hash_sub: int | None = HASH_SUB  # cached: reads.Piece reads and hashes each block in parts

    def __init__(self, path: str, *, direct: bool = True) -> None:
        self.path = path
        self.fd = _open_regular(path)
        self.dfd: int | None = None
        self.direct_bytes = 0  # bytes read through O_DIRECT (tests and benchmarks read it)
        try:  # a failure here (an fstat's EIO) closes what was opened: no caller holds the reader yet
            cached = _pagecache.cached_fraction(self.fd)
            self.cold = cached is not None and cached < 0.9  # io groups small reads of a cold file
            if self.cold:
                self.piece_bytes, self.hash_sub = COLD_READ_PIECE, None
                if direct and direct_io_enabled():
                    self.dfd = self._open_direct()
                    if self.dfd is not None:
                        self.piece_bytes = COLD_DIRECT_PIECE
        except BaseException:
            self.close()
            raise
        self.direct_ok = self.dfd is not None

    def _open_direct(self) -> int | None:
        """A second descriptor with O_DIRECT on the same file (same inode as ``self.fd``: the
        path is not trusted twice), or None when the filesystem refuses it."""
        flags = os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            dfd = os.open(self.path, flags)
        except OSError:
            return None
        try:
            a, b = os.fstat(self.fd), os.fstat(dfd)
        except BaseException:
            os.close(dfd)  # not left open by an fstat that failed (EIO, ESTALE on NFS)
            raise
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(dfd)
            return None
        return dfd

    def readinto(self, buf: memoryview, offset: int) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if self.direct_ok and len(view) >= DIRECT_MIN:
            if direct_split(view, offset, self._direct, self._buffered):
                return
            # At another page phase than the offset (not refused: then direct_ok is False now).
            if self.direct_ok and buffer_address(view) is not None and self._bounced(view, offset):
                return
        self._buffered(view, offset)

    def readv_into(self, bufs: list[memoryview], offset: int) -> int:
        """One ``preadv`` from ``offset`` into ``bufs`` in turn (cached small reads, ``reads.
        ScatterPiece``); returns the bytes read, which the caller checks."""
        try:
            return os.preadv(self.fd, bufs, offset)
        except OSError as e:
            raise OSError(e.errno, f"{self.path}: {e.strerror}") from e

    def _bounced(self, view: memoryview, offset: int) -> bool:
        """A cold read into memory at another page phase than the file offset: whole pages
        read with O_DIRECT into a page-aligned bounce buffer, then copied into place (one
        memcpy, cheaper than filling the page cache). False (nothing read) if refused."""
        bounce = bounce_get()
        try:
            done, n = 0, len(view)
            while done < n:
                o = offset + done
                lo = o - o % DIRECT_ALIGN
                step = min(n - done, len(bounce) - (o - lo))
                need = o + step - lo
                hi = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
                try:
                    got = os.preadv(self.dfd, [bounce[:hi]], lo)  # type: ignore[arg-type]
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct_ok = False  # refused: buffered from now on
                    if done == 0:
                        return False
                    self._buffered(view[done:], o)
                    return True
                if got < need:  # short (end of file, or off the grid): the rest buffered
                    self._buffered(bounce[got:need], lo + got)
                view[done : done + step] = bounce[o - lo : need]
                done += step
        finally:
            bounce_put(bounce)
        with _LOCK:
            self.direct_bytes += n
        return True

    def _buffered(self, view: memoryview, offset: int) -> None:
        done, n = 0, len(view)
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                self._truncated(n, offset, done)
            done += got

    def _direct(self, view: memoryview, offset: int) -> bool:
        """Read aligned pages with O_DIRECT; False (nothing read) if the kernel refuses."""
        done, n = 0, len(view)
        while done < n:
            try:
                got = os.preadv(self.dfd, [view[done:]], offset + done)  # type: ignore[arg-type]
            except OSError as e:
                if e.errno == errno.EINVAL and done == 0:
                    self.direct_ok = False  # refused (alignment rules of this device): buffered from now on
                    return False
                raise
            if got == 0:
                self._truncated(n, offset, done)
            if got % DIRECT_ALIGN:  # a short read off the grid: finish buffered
                self._buffered(view[done + got :], offset + done + got)
                got = n - done
            done += got
        with _LOCK:
            self.direct_bytes += n
        return True

    def _truncated(self, n: int, offset: int, done: int) -> None:
        from ..errors import CorruptCheckpointError

        raise CorruptCheckpointError(
            f"{self.path}: truncated: wanted {n} bytes at offset {offset}, file ended after {done}",
            file=os.path.basename(self.path),
        )

    def close(self) -> None:
        # The O_DIRECT descriptor stays open until here even after a refusal: other threads
        # may still be reading through it, and a closed number can be reused by the next open.
        for fd in (self.dfd, self.fd):  # both, even when one reports an error (Linux released it anyway)
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.dfd, self.fd = None, -1


class LocalStorage(_LocalDirs):
    atomic_rename = True
    direct_io = True  # open_write(path, direct=True) is understood

    def read_bytes(self, path: str, limit: int) -> bytes:
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as f:
            # Never ask for more than the file holds: read(n) allocates n bytes up front.
            return f.read(min(os.fstat(fd).st_size, limit) + 1)

    def open_write(self, path: str, *, direct: bool = False) -> _LocalWriter:
        """A writer for a new data file; ``direct``: send aligned pages through O_DIRECT."""
        return _LocalWriter(path, direct=direct)

    def open_read(self, path: str, *, direct: bool = True) -> _LocalReader:
        """A reader; ``direct=False``: no O_DIRECT even when the file is cold (other processes
        of this machine read the same bytes: through the page cache the disk is read once)."""
        return _LocalReader(path, direct=direct)
