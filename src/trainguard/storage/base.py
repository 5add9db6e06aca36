"""The storage protocol: the handful of operations commit and I/O need.

Paths are strings in the backend's own namespace ("/abs/dir" locally, "bucket/run1" for an
object store). Directory operations are on "directories" as the backend understands them.
"""

from __future__ import annotations

from typing import Protocol


class FileWriter(Protocol):
    """From ``Storage.open_write``: one per data file, on the rank that writes it;
    ``pwrite`` (any threads), then ``finish`` once, or ``abort`` on failure."""

    def pwrite(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset``; may be called from several threads at once."""

    def finish(self, size: int) -> None:
        """Make the file exactly ``size`` bytes and durable (fsync), then close it."""

    def abort(self) -> None:
        """Close without making anything durable (the temp directory is removed later)."""


class FileReader(Protocol):
    """From ``Storage.open_read``: ``readinto`` (any threads), then ``close``."""

    def readinto(self, buf: memoryview, offset: int) -> None:
        """Fill all of ``buf`` from ``offset``; raises on a short read. Thread-safe."""

    def close(self) -> None: ...


class Storage(Protocol):
    """A backend (``for_path`` picks one). Every rank writes its own data and index files under
    the save's directory; rank 0 alone writes the manifest, renames, and removes (cleanup,
    retention). Readers (load, verify, list) may run in any process."""

    #: True when ``rename_dir`` is atomic (POSIX): commit then writes into a temp directory
    #: and renames it. Object stores write in place and treat the manifest as the marker.
    atomic_rename: bool

    def join(self, *parts: str) -> str: ...
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str, limit: int) -> bytes: ...
    def write_atomic(self, path: str, data: bytes) -> None:
        """Write a small file so it appears whole or not at all (temp + fsync + rename); with
        ``atomic_rename``, the directory is fsynced after (the commit relies on it)."""
    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename; fails if ``dst`` exists; the parent is fsynced after."""
    def remove_tree(self, path: str) -> None: ...
    def open_write(self, path: str) -> FileWriter: ...
    def open_read(self, path: str) -> FileReader: ...
    def fsync_dir(self, path: str) -> None: ...
