"""Pause Python's cyclic garbage collector around the synchronous parts of a save or load.

Measured with 10,000 small tensors: GC passes triggered by the many short-lived objects of
planning took half of the save (0.75 s -> 0.37 s) and of the load (0.95 s -> 0.51 s). Nothing
trainguard allocates there forms reference cycles. Re-entrant and thread-safe: the collector is
re-enabled when the outermost user leaves, and only if it was enabled before.

An async save holds a pause from its call until its thread ends (:func:`hold`/:func:`release`,
not bound to a thread): everything it builds per tensor (leaves, byte views, write records, the
manifest's entries: ~20 tracked objects a tensor) lives through the write, seconds, and young
collections meanwhile would promote it all to the oldest generation, where it counts towards
CPython's next *full* collection (one per 25% growth of the old generation). Measured on this VM
(``python -m bench.gc_full``, 60 async saves with 2 small steps before each, one process): 632
tensors, 0 full collections with the hold against 3 of ~127 ms without; 1,264 tensors, 0 against
8 (1.0 s in all); none in the same loop without saves. A hold expires after its
``seconds`` (:func:`expire`, from the optimizer pre-step hook and the next save), so a save stuck
in a write cannot keep the collector off. The cost: reference cycles the training loop drops
meanwhile are freed when the save ends instead of at the next young collection.

The first allocation after re-enabling starts a young-generation pass over what survived the
pause (the manifest: 16-35 ms for 10,000 tensors). Not avoided on purpose: moving the young
objects to the oldest generation (``gc.freeze()`` + ``gc.unfreeze()``, measured to remove the
pass) would also move the training loop's young garbage cycles there, where a cycle holding CUDA
tensors can wait for a full collection for a long time.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_threads: dict[int, int] = {}  # thread ident -> its depth (for a forked child: :func:`after_fork_in_child`)
_held: dict[int, float] = {}  # hold token -> its deadline (time.monotonic)
_tokens = 0


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    me = threading.get_ident()
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
        _threads[me] = _threads.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            _threads[me] -= 1
            if not _threads[me]:
                del _threads[me]
            if _depth == 0 and _was_enabled:
                gc.enable()


# How long an async save may keep the collector paused: a save still writing after this lets it
# run again (an occasional full collection matters little in a save that long).
ASYNC_HOLD_S = 120.0


@contextmanager
def held(seconds: float) -> Iterator[int]:
    """:func:`hold` for the block, released if it raises; else its token's owner releases it."""
    token = hold(seconds)
    try:
        yield token
    except BaseException:
        release(token)
        raise


def hold(seconds: float) -> int:
    """Pause the collector until :func:`release` of the returned token (from any thread) or for at
    most ``seconds`` (:func:`expire`). ``async_save.start_async_save``, in the save's call; its
    save thread releases it when it ends."""
    global _depth, _was_enabled, _tokens
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
        _tokens += 1
        _held[_tokens] = time.monotonic() + seconds
        return _tokens


def release(token: int) -> None:
    """End the pause of :func:`hold`'s ``token``; nothing if it ended already (expired, released)."""
    global _depth
    with _lock:
        if _held.pop(token, None) is None:
            return
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()


def expire() -> None:
    """End the holds past their deadline. Cheap when there is none (every optimizer step asks)."""
    if not _held:
        return
    now = time.monotonic()
    for token, deadline in list(_held.items()):
        if deadline <= now:
            release(token)


def after_fork_in_child() -> None:
    """``forks``' at-fork hook, in a forked child: only the forking thread lives on, so only its
    pauses count (another thread's would keep the collector off for good), and the lock is new
    (held by another thread at the fork, it would stay held); no async save's hold."""
    global _lock, _depth, _threads
    me = threading.get_ident()
    _held.clear()  # an async save's: its thread runs in the parent only
    _lock, _threads = threading.Lock(), {me: _threads[me]} if me in _threads else {}
    _depth = _threads.get(me, 0)
    if _depth == 0 and _was_enabled and not gc.isenabled():
        gc.enable()
