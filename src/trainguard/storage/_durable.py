"""Directory operations of ``LocalStorage`` that must survive a power loss, not only a crash of
the process: after one, a directory entry (a create, mkdir, rename or unlink) is there only if
its directory was fsynced after it (tests/test_fsync_review.py checks the order of the calls)."""

from __future__ import annotations

import logging
import os
import shutil

from ..layout import MANIFEST, TMP_RE

log = logging.getLogger("trainguard")


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (``LocalStorage.fsync_dir``)."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(path: str) -> None:
    """``LocalStorage.makedirs``: create ``path`` and its missing parents (a manager's run root at
    ``open``, the parents of ``tg.save``'s path, a save's temp directory). Each directory created
    is made durable in its parent (the parent fsynced), else a power loss could take a new run
    directory, and every checkpoint committed in it, away after the saves reported success. A
    temp directory's own entry is not: it is renamed into place, and that rename is fsynced."""
    created, p = [], os.path.abspath(path)
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        created.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    for d in reversed(created):
        if d != created[0] or not TMP_RE.match(os.path.basename(d)):
            try:
                fsync_dir(os.path.dirname(d))
            except PermissionError:  # a parent one may write into but not read (mode -wx): cannot be opened
                log.warning("trainguard: cannot fsync %s (no read permission); %s may not survive a power loss",
                            os.path.dirname(d), d)


def remove_tree(path: str) -> None:
    """``LocalStorage.remove_tree`` of a directory (retention, debris cleanup, a failed save's temp
    directory): its manifest first, durably (the directory fsynced), then the rest, so that a
    delete cut short, by a crash or a power loss, leaves no manifest whose data is gone. When the
    manifest cannot be removed (EIO, EPERM) or its removal cannot be made durable (the fsync
    fails), nothing else is: a warning, and the directory is left for the next cleanup (a whole
    checkpoint, or one without its manifest: debris). Never raises (callers clean up on error paths)."""
    try:
        os.unlink(os.path.join(path, MANIFEST))
        fsync_dir(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # no manifest (a temp directory), or nothing there
    except OSError as e:
        log.warning("trainguard: could not remove %s (left for the next cleanup): %s", path, e)
        return
    try:  # ignore_errors does not cover a directory descriptor's close failing (EIO) in Python 3.11
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):  # an entry refused (EACCES, EBUSY): once more, to say why (it was silent)
            shutil.rmtree(path)
    except OSError as e:
        log.warning("trainguard: could not remove all of %s (left for the next cleanup): %s", path, e)
