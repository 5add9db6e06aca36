"""``DistContext``: processes and the c10d store (with ``dtensor.py``, the only modules that know torch.distributed).

One process: :class:`DistContext`, a null object. Many: :class:`StoreDistContext`, whose collectives
go through the c10d *store* (never the training process group: a background save thread may
coordinate while training runs its own collectives; a dead or absent rank is an error naming it).

Every rank calls the collectives in the same order. Rank 0 coordinates: it waits for every rank's
key, watching heartbeats, and publishes the result or one failure record (every rank raises the
*same* ``RankFailureError``): a rank never arriving after ``timeout``, one whose heartbeat stopped
after ``TRAINGUARD_DEAD_AFTER`` s, one in a *different* collective of the round or that left the
call, at once (``distwait.py``). Rounds are numbered within *operations* (the public calls,
:meth:`operation`): a rank that left one midway (a Ctrl-C it caught) meets the others at the next.

``StoreDistContext``'s collectives and waits are inherited from ``distrounds._StoreRounds``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .distrounds import _store_errors, _StoreRounds  # noqa: F401  (_store_errors: its home was here)
from .distwait import LEFT, STARTED, check_timeout, dead_after, default_timeout, wait_for  # noqa: F401 - imported from here
from .errors import RankFailureError, failure, failure_record, from_record, summary  # noqa: F401 - failure, summary: imported from here too
from .permanent import headline, is_permanent
from .storecall import BoundedStore

HEARTBEAT_EVERY = 0.5
F = TypeVar("F", bound=Callable[..., Any])


class DistContext:
    """The single-process context (also the base class): rank 0 of 1, collectives are identity."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank contributes a JSON value; every rank gets the list, indexed by rank."""
        return [value]

    def gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank contributes a JSON value; rank 0 gets the list, the others ``None`` at once.

        A failure to collect (a rank died or never came) raises ``RankFailureError`` on rank 0
        only: the caller must pass it on to the others (``api`` does, in its "commit" broadcast).
        """
        return [value]

    def broadcast(self, tag: str, value: Any = None, *, timeout: float | None = None) -> Any:
        """Rank 0's value, on every rank."""
        return value

    def fence(self, tag: str, claim: Any) -> Any:
        """The first ``claim`` made under ``tag`` by any rank; one process: its own."""
        return claim

    def close(self, wait: float = 0.0) -> None:
        pass

    def mark(self) -> Any:
        """The last round this channel entered: :meth:`forget` it once every rank is past it."""
        return None

    def forget(self, mark: Any) -> None:
        """Rank 0: delete (in the background) the store keys of rounds up to ``mark``."""

    def raise_flag(self, name: str) -> None:
        """Any rank, outside the collectives: set job-wide flag ``name`` (one store call)."""

    def flag_raised(self, name: str) -> bool:
        """Rank 0: whether any rank raised flag ``name`` (one store call)."""
        return False

    def channel(self, name: str, *, follow: bool = False) -> DistContext:
        """A context whose collectives are sequenced apart from this one's (see StoreDistContext)."""
        return self

    @contextlib.contextmanager
    def operation(self, *, eager: bool = False) -> Iterator[None]:
        """Around each public call that may run collectives, on every rank (see StoreDistContext)."""
        yield

    def rounds_follow(self) -> None:
        """In an operation: every rank's call runs rounds from here on (see StoreDistContext)."""

    def hand_off(self, off: bool) -> None:
        """``start_async_save``: its thread runs this operation's rounds (``off``): the call raising is not leaving it."""

    @staticmethod
    def current() -> DistContext:
        """The context for this process: store-based when torch.distributed is initialised."""
        import torch.distributed as dist

        if _FORKED_CHILD or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return _NULL
        if getattr(_LOCAL, "ctx", None) is not None:  # in a manager's call: its channel (a restore's tg.load)
            return _LOCAL.ctx  # type: ignore[no-any-return]
        store = dist.distributed_c10d._get_default_store()
        with _MAKING:  # one context per group: two threads' first calls made two (generations apart)
            # Keyed by the default group's store, which the context holds (its id() cannot be reused while it
            # lives): a group made after destroy_process_group has a new store. Not by the group itself: a
            # reference kept here would outlive destroy_process_group, and gloo's group then torn down during
            # interpreter finalization aborted a rank ("terminate called without an active exception").
            ctx = _CACHE.get(id(store))
            if ctx is None or ctx.store.raw is not store:
                ctx = StoreDistContext(store, dist.get_rank(), dist.get_world_size())
                for old in _CACHE.values():
                    old.close()
                _CACHE.clear()
                _CACHE[id(store)] = ctx
        return ctx


def one_operation(fn: F) -> F:
    """``tg.save``/``tg.load``: one operation (:meth:`StoreDistContext.operation`), numbered at once."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with DistContext.current().operation(eager=True):
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


_NULL = DistContext()
_CACHE: dict[int, StoreDistContext] = {}  # id(store) -> the context using that store (it keeps the store alive)
_FORKED_CHILD = False  # forks.py: forked from a rank of an initialised group; not a rank itself
_MAKING = threading.Lock()
_LOCAL = threading.local()  # .ctx: the channel whose operation this thread is in (StoreDistContext.operation)


@atexit.register
def _stop_heartbeats() -> None:
    """At interpreter exit, stop the heartbeat threads before torch's objects are torn down: a
    daemon thread still inside a C++ store call during finalization can abort the process
    ("terminate called without an active exception", seen once in an example's exit)."""
    for ctx in list(_CACHE.values()):
        ctx.close(wait=2.0)  # and the store's thread, with its background deletes
        hb = getattr(ctx, "_hb", None)
        if hb is not None:
            hb.join(timeout=2.0)


class StoreDistContext(_StoreRounds, DistContext):
    """Collectives through a c10d ``Store`` with liveness: each rank bumps a heartbeat key from a
    daemon thread; rank 0 declares a rank dead when its heartbeat stops moving.

    Cost per collective: each rank sets one key and reads one; rank 0 reads ``world_size`` keys
    in one ``multi_get``. Rank 0 deletes the keys of rounds every rank has passed, in the
    background (``forget``).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, dead_after_s: float | None = None) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, int(os.environ.get("LOCAL_RANK", rank))
        self.dead_after = dead_after() if dead_after_s is None else dead_after_s
        self.store = BoundedStore(store, self.dead_after)  # a frozen store host: an error, not a hang
        # All ranks create their context at their first collective call; the counter gives
        # the same generation to all of them, so keys of an earlier job on the store never clash.
        gen = (int(store.add("trainguard/contexts", 1)) - 1) // world_size
        self.prefix = f"trainguard/{gen}"  # heartbeats live here, shared by every channel
        self.chan = f"{self.prefix}/main"  # rounds and "at" keys of this channel
        self._op, self._round = 0, 0  # the operation (public call) and the round within it
        self._depth, self._new_op, self._in_op, self._parent, self._base = 0, False, False, None, self  # operation(); channel()
        self._keys: dict[tuple[int, int], tuple[str, bool, bool]] = {}  # rank 0: (op, round) -> (tag, "/all" key, per-rank keys)
        self._fences: list[tuple[tuple[int, int], str]] = []  # rank 0: ((op, round), fence key) claimed in that round, or other key (distwait)
        self._channels: dict[str, StoreDistContext | int] = {}  # an int: how often that name's was dropped (distwait.drop_channel)
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, name="trainguard-heartbeat", daemon=True)
        self._hb.start()

    def channel(self, name: str, *, follow: bool = False) -> StoreDistContext:
        """A context with its own sequence of collectives, sharing this one's store and heartbeat.

        Collectives of one channel must be called in the same order on every rank; those of two
        channels may interleave differently: each ``CheckpointManager`` has one (its root's name;
        two managers used from two threads), and ``follow``: the async save's of this one (its
        thread's rounds, while the training thread goes on), whose operations take this one's numbers.
        """
        home = self if follow else self._base
        ch = home._channels.get(name)
        if not isinstance(ch, StoreDistContext):  # none yet, or dropped n times: named apart from those (its keys)
            n, ch = ch or 0, object.__new__(StoreDistContext)
            ch.__dict__.update(home.__dict__)
            ch._parent, ch.chan, ch._op, ch._round, ch._channels, ch._keys, ch._fences = self if follow else None, f"{home.chan}/{name}{f'#{n}' if n else ''}", 0, 0, {}, {}, []
            ch._depth, ch._new_op, ch._in_op, ch._dropped = 0, False, False, n
            home._channels[name] = ch
        return ch

    def _beat(self) -> None:
        key = f"{self.prefix}/hb/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.raw.add(key, 1)  # unbounded: a slow store must not stop this rank's beat
            except Exception:
                return  # the store is gone (job ending); nothing to report to
            self._stop.wait(HEARTBEAT_EVERY)

    def close(self, wait: float = 0.0) -> None:
        self._stop.set()
        self.store.close(wait)

    # -- collectives -------------------------------------------------------------------------
    # Each public collective turns a store that stopped answering (its host died: rank 0 with
    # env:// rendezvous, or the launcher) into the RankFailureError every other failure gives.

    @contextlib.contextmanager
    def operation(self, *, eager: bool = False) -> Iterator[None]:
        """Around each public call that may run collectives, on every rank: ``tg.save``, ``tg.load``, a
        ``CheckpointManager``'s ``open``/``save``/``wait``/``restore``/``close`` (nested calls: part of the
        outer one); on the async-save channel, each save (its thread runs the rounds after this block).

        Every rank numbers its calls alike (a call is numbered at its first round, or at once: ``eager``,
        :meth:`rounds_follow`), and the rounds within each from 1. A rank that raised out of a numbered
        call (a Ctrl-C its caller caught and went on: the others wait in rounds it skipped) marks itself
        ``LEFT``: the others fail that call at once, and the next call pairs the ranks again.
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth, self._new_op, self._in_op, prev = 1, True, False, getattr(_LOCAL, "ctx", None)
        _LOCAL.ctx = self if self._parent is None else prev  # nested calls of this thread (DistContext.current)
        if eager:
            self._next_op()
            with contextlib.suppress(Exception):  # a channel's (async) save started here: see distwait.STARTED
                self._parent is None or self.store.set(f"{self.chan}/at/{self.rank}", json.dumps([self._op, 0, STARTED]))
        try:
            yield
        except BaseException as e:
            why = [headline(str(e))] if is_permanent(e) else []  # no restart fixes it: the others fail so, at once
            if why and self._new_op:  # not numbered yet (its first round to come): now, as the others' call is
                self._next_op()
            if self._in_op:  # this rank entered the call's rounds: tell the others it left
                with contextlib.suppress(Exception), self.store.hasty():  # not after the bound behind a stalled call
                    self.store.set(f"{self.chan}/at/{self.rank}", json.dumps([self._op, 0, LEFT, *why]))
            raise
        finally:
            self._depth, self._new_op, _LOCAL.ctx = 0, False, prev

    def rounds_follow(self) -> None:
        """Number the call now (a manager's ``open``/``restore``/``save``): a rank raising before its first
        round (a Ctrl-C in the wait for the previous save) is ``LEFT``, not paired by its next call."""
        if self._depth and self._new_op:
            self._next_op()

    def hand_off(self, off: bool) -> None:
        self._in_op = not off

    def _next_op(self) -> None:
        # A channel (the async save's) takes its parent's number: equal on every rank after a save one skipped.
        op = max(self._op + 1, self._parent._op if self._parent is not None else 0)
        self._op, self._round, self._new_op, self._in_op = op, 0, False, True

    def mark(self) -> tuple[int, int]:
        return self._op, self._round

    def raise_flag(self, name: str) -> None:
        self.store.set(f"{self.prefix}/{name}", "1")

    def flag_raised(self, name: str) -> bool:
        return bool(self.store.check([f"{self.prefix}/{name}"]))

    def forget(self, mark: tuple[int, int] | None) -> None:
        """Rank 0, in a round every rank entered: delete in the background the keys of rounds up to
        ``mark`` (operation, round; two back: all passed the round after, and every earlier
        operation), broadcasts' too, and their fences."""
        if self.rank != 0 or mark is None:
            return
        keys = []
        for r in [r for r in self._keys if r <= mark]:
            tag, all_key, per_rank = self._keys.pop(r)
            base = f"{self.chan}/r{r[0]}.{r[1]}/{tag}"
            keys += [f"{base}/all"] if all_key else []
            keys += [f"{base}/{k}" for k in range(self.world_size)] if per_rank else []
        while self._fences and self._fences[0][0] <= mark:
            keys.append(self._fences.pop(0)[1])
        self.store.discard(keys)

