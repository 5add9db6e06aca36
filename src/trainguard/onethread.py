"""``CheckpointManager``'s ``save``/``wait``/``restore``/``close``: one thread at a time.

The manager keeps one save in flight and collects it at the next call; it was never meant to be
called from two threads at once, and nothing said so. Two threads' ``mgr.save`` of async saves
collected one handle twice and another never: ``save`` events duplicated and missing in
``events.jsonl``, the skipped steps' retention and policy accounting lost (sync saves: warnings
about checkpoints "this run did not write"). Now a second thread entering while another is inside
gets a ``CheckpointError`` saying so; re-entry from the same thread (``close()`` -> ``wait()``) is fine.

Each outermost call is also one *operation* of the manager's ``DistContext`` (its collectives are
numbered per call on every rank, ``dist.StoreDistContext.operation``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from . import forks
from .errors import CheckpointError

F = TypeVar("F", bound=Callable[..., Any])
_GUARD = threading.RLock()  # the check-and-set of a manager's owner (an RLock: a signal handler may enter)


def one_thread_at_a_time(*names: str, rounds: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator of ``CheckpointManager``: its methods ``names`` raise in a thread that
    enters one while another thread is inside one of them, on the same manager. ``rounds``: those
    that run collective rounds on every rank, numbered from their start (``DistContext.rounds_follow``)."""

    def wrap(cls: type) -> type:
        for name in names:
            setattr(cls, name, _guarded(getattr(cls, name), name in rounds))
        return cls

    return wrap


def _guarded(method: F, eager: bool = False) -> F:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if forks.manager_call(self, method.__name__):  # opened by the process that forked this one
            return None
        me, owner = threading.get_ident(), None
        try:  # the mark is taken inside the try: a Ctrl-C after it still clears it
            with _GUARD:
                owner = self.__dict__.get("_inside")
                if owner is None:
                    self.__dict__["_inside"] = me
            if owner is not None and owner != me:
                raise CheckpointError(
                    f"CheckpointManager.{method.__name__}() called from a second thread while another thread is "
                    "inside this manager: a manager is used from one thread at a time (one per thread, or a lock)"
                )
            ctx = self.__dict__.get("ctx")
            with ctx.operation(eager=eager) if ctx is not None else contextlib.nullcontext():  # dist.StoreDistContext.operation
                return method(self, *args, **kwargs)
        finally:
            if owner is None and self.__dict__.get("_inside") == me:
                self.__dict__["_inside"] = None

    return guarded  # type: ignore[return-value]
