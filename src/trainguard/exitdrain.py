"""What the interpreter's exit waits for, in this order: the async save in flight
(``async_save._drain_at_exit``), then each RAM tier's copy to disk (``ramroom.drain_copies``), which
that save's commit may have started; before the non-daemon threads are joined and again after.
Imported by the package's ``__init__`` (torch-free: the two modules are looked up when the exit
comes; not imported, nothing of theirs is in flight); :func:`after_threads` by :mod:`.forks`.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered first: ours runs before it)
import sys
import threading


def _at_exit() -> None:
    a, r = sys.modules.get("trainguard.async_save"), sys.modules.get("trainguard.ramroom")
    if a is not None:
        a._drain_at_exit()
    if r is not None:
        r.drain_copies()


# threading's own exit hooks run before its threads are joined and in reverse order of
# registration: this one, registered after concurrent.futures', runs before it (atexit would
# run after it, when no executor accepts work any more), and before the hooks a script
# registers after `import trainguard`.
try:
    getattr(threading, "_register_atexit", atexit.register)(_at_exit)
except RuntimeError:  # first imported after the exit began (a thread's, after the main one ended):
    pass  # threading refuses; after_threads' atexit call runs once that thread is joined
_LATE: list[bool] = []


def after_threads() -> None:
    """Once more after the non-daemon threads were joined: a save (or RAM tier copy) that one of them
    started after the first call (training in a thread while the main thread had ended) was dropped
    with the exit, its checkpoint left a temp directory; a no-op when nothing is in flight.
    permanent._finish (exit 78 under `trainguard run`) runs the atexit handlers only: this one too.
    Registered by :mod:`.forks` (after torch's and ``dist``'s atexit hooks: runs before them), once."""
    if hasattr(threading, "_register_atexit") and not _LATE:
        _LATE.append(True)
        atexit.register(_at_exit)
