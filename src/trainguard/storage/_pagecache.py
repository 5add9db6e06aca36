"""Page-cache residency (Linux ``cachestat``) and O_DIRECT reads through a bounce buffer.

Used by ``local._LocalReader`` only: it asks :func:`cached_fraction` once per file and
:func:`cached` per piece, and reads uncached pieces with :func:`read_direct`. Everything
degrades to "unknown, read the ordinary way": no ``cachestat`` (kernel < 6.5, not Linux, a
seccomp filter), no O_DIRECT (tmpfs, FUSE), no ctypes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses: a multiple of this
BOUNCE = (4 << 20) + 2 * ALIGN  # one piece plus alignment slack at each end
_SYS_CACHESTAT = 451  # the same number on every Linux architecture


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _syscall() -> Callable[..., int] | None:
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_SYSCALL = _syscall()
_works = _SYSCALL is not None


def _cachestat(fd: int, off: int, length: int) -> int | None:
    """Pages of ``[off, off+length)`` (length 0: to the end) in the page cache; None: unknown."""
    global _works
    if not _works:
        return None
    st = _Stat()
    if _SYSCALL(_SYS_CACHESTAT, fd, ctypes.byref(_Range(off, length)), ctypes.byref(st), 0) != 0:
        _works = False  # ENOSYS, EPERM (seccomp), ...: stop asking
        return None
    return st.nr_cache


def cached_fraction(fd: int) -> float:
    """The fraction of the file's pages in the page cache (1.0 when unknown or empty)."""
    size = os.fstat(fd).st_size
    pages = -(-size // mmap.PAGESIZE)
    got = _cachestat(fd, 0, 0) if pages else None
    return 1.0 if got is None else min(1.0, got / pages)


def cached(fd: int, off: int, length: int) -> bool:
    """Whether any page of ``[off, off+length)`` is cached (True when unknown): a piece partly
    in the page cache is read the ordinary way, which is cheap for the cached part."""
    got = _cachestat(fd, off, length)
    return got is None or got > 0


def open_direct(fd: int) -> int:
    """An O_DIRECT descriptor of the file open as ``fd`` (the same inode, through /proc), or
    -1 where O_DIRECT or /proc is unavailable."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_DIRECT", 0)
    if not _works:
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", flags)
    except OSError:
        return -1


_free: list[tuple[mmap.mmap, int]] = []
_free_lock = threading.Lock()


def _get_bounce() -> tuple[mmap.mmap, int]:
    """A bounce buffer (page-aligned: anonymous mmap) and its address; kept for reuse (a few
    at most) since fresh pages are slow to fault in."""
    with _free_lock:
        if _free:
            return _free.pop()
    m = mmap.mmap(-1, BOUNCE)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _put_bounce(b: tuple[mmap.mmap, int]) -> None:
    with _free_lock:
        if len(_free) < 4:
            _free.append(b)


def read_direct(dfd: int, view: memoryview, offset: int, truncated: Callable[[int, int, int], Exception]) -> None:
    """Fill ``view`` from ``offset`` of the O_DIRECT descriptor ``dfd``: aligned reads into the
    bounce buffer, each copied into ``view`` (ctypes.memmove: the GIL is released). Raises
    ``truncated(n, offset, done)`` at end of file, OSError(EINVAL) if alignment is refused."""
    b = _get_bounce()
    m, baddr = b
    dest = ctypes.addressof(ctypes.c_char.from_buffer(view))
    n = len(view)
    pos, end = offset, offset + n
    with memoryview(m) as buf:
        while pos < end:
            a0 = pos - pos % ALIGN
            a1 = min(end + (-end) % ALIGN, a0 + BOUNCE)
            got = os.preadv(dfd, [buf[: a1 - a0]], a0)
            take = min(a0 + got, end) - pos
            if take <= 0:
                raise truncated(n, offset, pos - offset)
            ctypes.memmove(dest + (pos - offset), baddr + (pos - a0), take)
            pos += take
    _put_bounce(b)
