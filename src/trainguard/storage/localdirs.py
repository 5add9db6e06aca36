"""``LocalStorage``'s directory and metadata operations, and its atomic small-file write (manifests, markers).

Moved out of ``local.py``: ``local.LocalStorage`` inherits these methods from ``_LocalDirs`` (nobody else uses
the class); its data files' readers and writers (``open_read``/``open_write``/``read_bytes``) stay there.
Called through the ``Storage`` interface by the manager, commit, retention and the CLI, from any rank and
thread; ``rename_dir`` and ``write_atomic`` fsync the parent directory so that a commit's rename is durable.
"""

from __future__ import annotations

import contextlib
import errno
import os

from . import _durable
from ._diskfull import disk_error as _disk_error
from ._diskfull import progress as _progress


class _LocalDirs:
    """Paths, directories and metadata of :class:`~trainguard.storage.local.LocalStorage` (its only subclass)."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def makedirs(self, path: str) -> None:
        _durable.makedirs(path)  # each new directory fsynced into its parent

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        """False only when ``path`` is not there; another error (EIO, EACCES) is raised: os.path.exists
        answers False to it, and a manager's open deleted a committed step whose manifest's stat failed."""
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:  # a symbolic link loop is there: opening it (O_NOFOLLOW) finds it corrupt, as any link
            if e.errno != errno.ELOOP:
                raise
        return True

    def size(self, path: str) -> int:
        return os.stat(path, follow_symlinks=False).st_size

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[_progress(os.write(fd, view)) :]
            os.fsync(fd)
        except BaseException as e:  # an I/O error, or Ctrl-C: neither the descriptor nor the temp file left
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise _disk_error(e, path, len(data)) from e
            raise
        os.close(fd)
        os.replace(tmp, path)
        self.fsync_dir(os.path.dirname(path))

    def rename_dir(self, src: str, dst: str) -> None:
        if os.path.exists(dst):
            raise FileExistsError(errno.EEXIST, "exists", dst)
        os.rename(src, dst)
        self.fsync_dir(os.path.dirname(dst))

    def remove_tree(self, path: str) -> None:
        """Manifest first (durably): a delete cut short leaves no manifest whose data is gone. A
        symlink (a checkpoint linked into the run directory) is unlinked; what it points at stays."""
        if os.path.islink(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        _durable.remove_tree(path)  # stops, data kept, when the manifest's removal is not durable

    def fsync_dir(self, path: str) -> None:
        _durable.fsync_dir(path)
