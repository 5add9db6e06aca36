"""What the interpreter's exit waits for, in this order: the async save in flight
(``async_save._drain_at_exit``), then each RAM tier's copy to disk (``ramroom.drain_copies``), which
that save's commit may have started. Imported by the package's ``__init__``, once.
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
