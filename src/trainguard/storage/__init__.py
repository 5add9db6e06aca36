"""Storage backends. ``Storage`` is the protocol the commit and I/O layers call; ``for_path``
picks a backend from a path or URL (local directories by default)."""

from __future__ import annotations

import os

from .base import FileReader, FileWriter, Storage
from .local import LocalStorage

__all__ = ["Storage", "FileReader", "FileWriter", "LocalStorage", "for_path"]


def for_path(path: str | os.PathLike[str], *, follow_link: bool = False) -> tuple[Storage, str]:
    """Return ``(storage, path inside it)`` for a local path or an fsspec URL (``s3://...``).
    ``follow_link`` (``api.save``): a local path that is a symbolic link gives the path it points
    to, so the checkpoint is written there (its commit renames directories: it would replace
    the link itself, and leave the directory it points to as it was)."""
    p = os.fsdecode(path)  # a bytes path too
    if "://" in p and not p.startswith("file://"):
        from .fsspec import FsspecStorage  # optional dependency

        return FsspecStorage.from_url(p)
    if p.startswith("file://"):
        p = p[len("file://") :]
    p = os.path.abspath(p)
    return LocalStorage(), os.path.realpath(p) if follow_link and os.path.islink(p) else p
