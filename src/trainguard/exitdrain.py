"""What the interpreter's exit waits for, in this order: the async save in flight
(``async_save._drain_at_exit``), then each RAM tier's copy to disk (``ramroom.drain_copies``), which
that save's commit may have started; before the non-daemon threads are joined and again after.
Imported by the package's ``__init__``, once.
"""

from __future__ import annotations

import atexit
import threading

from .async_save import _drain_at_exit
from .ramroom import drain_copies


def _at_exit() -> None:
    _drain_at_exit()
    drain_copies()


# threading's own exit hooks run before its threads are joined and in reverse order of
# registration: this one, registered after concurrent.futures', runs before it (atexit would
# run after it, when no executor accepts work any more).
getattr(threading, "_register_atexit", atexit.register)(_at_exit)
# Once more after the non-daemon threads were joined: a save (or RAM tier copy) that one of them
# started after the first call (training in a thread while the main thread had ended) was
# dropped with the exit, its checkpoint left a temp directory; a no-op when nothing is in flight.
# permanent._finish (exit 78 under `trainguard run`) runs the atexit handlers only: this one too.
if hasattr(threading, "_register_atexit"):
    atexit.register(_at_exit)
