"""Storage backends. ``Storage`` is the protocol the commit and I/O layers call; ``for_path``
picks a backend from a path or URL (local directories by default)."""

from __future__ import annotations

import os

from ._urls import file_url_path, is_file_url
from .base import FileReader, FileWriter, Storage
from .local import LocalStorage

__all__ = ["Storage", "FileReader", "FileWriter", "LocalStorage", "absolute", "for_path", "local_path", "location"]


def for_path(path: str | os.PathLike[str], *, follow_link: bool = False) -> tuple[Storage, str]:
    """Return ``(storage, path inside it)`` for a local path or an fsspec URL (``s3://...``).
    ``follow_link`` (``api.save``): a local path that is a symbolic link gives the path it points
    to, so the checkpoint is written there (its commit renames directories: it would replace
    the link itself, and leave the directory it points to as it was)."""
    if not isinstance(path, (str, bytes, os.PathLike)):  # an unset `args.ckpt_dir`: os.fspath's message named no argument
        raise TypeError(f"checkpoint path {path!r}: pass a directory path (a str or os.PathLike) or a URL such as s3://bucket/run")
    p = os.fsdecode(path)  # a bytes path too
    if is_file_url(p):
        p = file_url_path(p)  # file:///x, file://localhost/x, file:/x
    elif "://" in p:
        from .fsspec import FsspecStorage  # optional dependency

        return FsspecStorage.from_url(p)
    if p.split(os.sep, 1)[0].startswith("~"):
        refuse_tilde(p)
    p = absolute(p)
    return LocalStorage(), os.path.realpath(p) if follow_link and os.path.islink(p) else p


def location(storage: Storage, path: str) -> str:
    """``path`` (in ``storage``'s own namespace, from ``for_path``) as the user wrote it: a string that
    ``for_path`` maps back to it (a URL, ``s3://bucket/run``, on an object store, whose namespace drops
    the scheme). Paths in messages go through it: ``bucket/run`` reads as a local relative path."""
    url = getattr(storage, "url", None)
    return url(path) if callable(url) else path


def refuse_tilde(path: str) -> None:
    """``for_path``: a local path whose first part starts with ``~`` (``"~/ckpts"``). Nothing expands it
    (no shell between the script and the call; ``open()`` does not either), so the save made a directory
    named ``~`` in the working directory, silently, and a restart from another directory found no
    checkpoint and started afresh. Refused, naming both directories (a permanent error)."""
    from ..errors import CheckpointError
    from ..permanent import mark

    raise mark(CheckpointError(
        f"{path!r} starts with '~', which trainguard does not expand (no more than open() does): it names "
        f"{absolute(path)}, in a directory called {path.split(os.sep, 1)[0]!r} in the working directory, not "
        f"{os.path.expanduser(path)}. "
        f"Pass os.path.expanduser({path!r}) for the home directory's, or {os.path.join('.', path)!r} for that one"))


def absolute(path: str) -> str:
    """``path`` made absolute as the kernel resolves it: the part up to its last ``..`` through
    ``realpath`` (``link/..`` is the parent of the link's target), the rest as given (a final link
    stays a link). ``os.path.abspath`` drops ``x/..`` by the letters: with ``x`` a symbolic link
    (``$SCRATCH/../proj/ckpts`` with ``$SCRATCH`` a link to ``/lustre/...``) the checkpoints went to
    another directory, maybe another file system, than ``ls``, ``cp`` or ``torch.save`` of the same
    path use. Called by ``for_path`` (every local path a save, load, manager or command is given)
    and by ``export``/``convert`` for their output."""
    parts = path.split(os.sep)
    if ".." not in parts:
        return os.path.abspath(path)
    last = len(parts) - 1 - parts[::-1].index("..")
    head = os.sep.join(parts[: last + 1]) or os.sep
    return os.path.abspath(os.path.join(os.path.realpath(head), *parts[last + 1 :]))


def local_path(path: str) -> str | None:
    """The local path that ``path`` (a path or a ``file:`` URL) names, as given (not made
    absolute), or None for an object-store URL: ``doctor`` and ``trainguard bench``, which look
    at the disk under it."""
    if is_file_url(path):
        return file_url_path(path)
    return None if "://" in path else path
