"""The at-fork reset of the modules that read checkpoints without torch (``trainguard ls``, ``inspect`` and
``verify``, or ``trainguard.inspect.verify`` in a script): in a forked child their locks are new (one held by
another thread at the fork stays held for good) and their record of storage calls in flight is empty.

:mod:`.forks`' reset calls it with the rest; ``trainguard/__init__.py``'s fork hook calls it alone where torch
is not imported: then none of the other modules :mod:`.forks` resets is (each imports torch), and importing
:mod:`.forks` in the child imported torch there (about 1 s and 200 MB in each child of a process that only
read checkpoints: tests/test_hunt51_cli51.py)."""

from __future__ import annotations

import threading

from . import gcpause, iostall
from .storage import _direct, local


def after_fork_in_child() -> None:
    """In a forked child (see the module's docstring for who calls it)."""
    gcpause.after_fork_in_child()  # a save or load of another thread paused the collector
    _direct._LOCK, local._LOCK = threading.Lock(), threading.Lock()
    iostall._OPEN.clear()  # the parent's storage calls in flight: none of this process's, never to end here
