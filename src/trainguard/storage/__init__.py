"""Storage backends. ``Storage`` is the protocol the commit and I/O layers call; ``for_path``
picks a backend from a path or URL (local directories by default)."""

from __future__ import annotations

import os

from .base import FileReader, FileWriter, Storage
from .local import LocalStorage

__all__ = ["Storage", "FileReader", "FileWriter", "LocalStorage", "for_path"]


def for_path(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """Return ``(storage, path inside it)`` for a local path or an fsspec URL (``s3://...``)."""
    p = os.fspath(path)
    if "://" in p and not p.startswith("file://"):
        from .fsspec import FsspecStorage  # optional dependency

        return FsspecStorage.from_url(p)
    if p.startswith("file://"):
        p = p[len("file://") :]
    return LocalStorage(), os.path.abspath(p)
