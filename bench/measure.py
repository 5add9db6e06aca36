"""Mechanisms shared by every measurement: peak extra RSS, durability (fsync), page-cache control.

No torch here. Everything works per process; the worker combines ranks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")
_READ_CHUNK = 16 << 20
_PREWARM_BUF: bytearray | None = None


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _load_libc()


def release_free_memory(full: bool = False) -> None:
    """Collect garbage and hand malloc's free pages back to the kernel (glibc ``malloc_trim``).

    Without it, memory freed by an earlier operation stays resident and is silently reused by
    the next one, which then appears to need no extra memory. ``full`` runs a full collection
    (fast once the worker has called ``gc.freeze()`` after its set-up); otherwise only the young
    generations.
    """
    gc.collect() if full else gc.collect(1)
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm_bytes() -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM missing from /proc/self/status")


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0: clear_refs "5")."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


class PeakMeter:
    """Extra RSS of this process during a ``with`` block: peak minus RSS at entry.

    Entry first releases free heap memory (see :func:`release_free_memory`), untimed.
    Preferred mode resets the kernel's VmHWM at entry and reads it at exit (exact, no sampling).
    Fallback: a thread samples /proc/self/statm every millisecond (can miss short peaks).
    RSS includes file pages mapped by the process (mmap loads count the pages they touch).
    """

    mode: str = "kernel VmHWM reset via /proc/self/clear_refs (exact peak RSS)"

    def __init__(self) -> None:
        self.extra = 0
        self._base = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def detect(cls) -> str:
        if not _reset_hwm():
            cls.mode = "sampling thread, /proc/self/statm every 1 ms (may miss short peaks)"
        return cls.mode

    def __enter__(self) -> PeakMeter:
        release_free_memory()
        self._base = _rss_bytes()
        if self.mode.startswith("kernel") and _reset_hwm():
            return self
        self._peak = self._base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            peak = _hwm_bytes()
        else:
            self._stop.set()
            self._thread.join(timeout=5)
            peak = max(self._peak, _rss_bytes())
        self.extra = max(0, peak - self._base)


def files_under(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, names in os.walk(root):
        for n in sorted(names):
            p = Path(dirpath) / n
            if p.is_file():
                yield p


def fsync_tree(root: Path) -> None:
    """Make everything under ``root`` durable: every file, every directory, and root's parent.

    Applied after every save, whether or not the method fsyncs itself: fsync of a clean file
    costs microseconds, and no method fsyncs the directory entries it created.
    """
    for p in files_under(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [Path(d) for d, _s, _f in os.walk(root)]
    for d in sorted(dirs, key=lambda x: len(x.parts), reverse=True) + [root.parent]:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in files_under(root))


def prewarm(root: Path) -> None:
    """Read every file once so a "hot" load really finds its bytes in the page cache.

    Needed because a method may write with O_DIRECT or drop its own pages after writing.
    """
    global _PREWARM_BUF
    if _PREWARM_BUF is None:
        _PREWARM_BUF = bytearray(_READ_CHUNK)  # allocated once: a fresh one costs page faults per call
    buf = _PREWARM_BUF
    for p in files_under(root):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


class CacheDropper:
    """Evicts a checkpoint's pages before a cold load; reports which mechanism was used."""

    def __init__(self, wanted: str) -> None:
        self.mode = self._choose(wanted)

    @staticmethod
    def _choose(wanted: str) -> str:
        if wanted in ("none", "fadvise"):
            return wanted
        if os.access("/proc/sys/vm/drop_caches", os.W_OK):  # root, and /proc/sys mounted read-write
            return "drop_caches"
        if wanted == "drop_caches":
            raise PermissionError("cannot write /proc/sys/vm/drop_caches: use --cold fadvise")
        return "fadvise"

    def describe(self) -> str:
        return {
            "drop_caches": "caches dropped with `sync; echo 3 > /proc/sys/vm/drop_caches` (whole machine)",
            "fadvise": "caches dropped with fsync + posix_fadvise(POSIX_FADV_DONTNEED) on every checkpoint file",
            "none": "not measured (--cold none)",
        }[self.mode]

    def drop(self, root: Path) -> None:
        """Call on one rank only: the page cache is shared by the processes of this machine."""
        if self.mode == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        elif self.mode == "fadvise":
            for p in files_under(root):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


class Deadline:
    """A wall-clock bound shared by the loops of one measurement."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end
