"""Pause Python's cyclic garbage collector around the synchronous parts of a save or load.

Measured with 10,000 small tensors: GC passes triggered by the many short-lived objects of
planning took half of the save (0.75 s -> 0.37 s) and of the load (0.95 s -> 0.51 s). Nothing
trainguard allocates there forms reference cycles. Re-entrant and thread-safe: the collector is
re-enabled when the outermost user leaves, and only if it was enabled before.

On leaving, the objects that survived the pause (the manifest of 10,000 tensors: ~40,000) are
moved to the oldest generation without a pass over them (``gc.freeze`` then ``gc.unfreeze``:
two list splices), instead of the young-generation pass that the first allocation after
``gc.enable`` would run over all of them (20-45 ms for 10,000 tensors). Skipped when the
program froze objects itself (``gc.get_freeze_count()``): unfreezing would undo that.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
