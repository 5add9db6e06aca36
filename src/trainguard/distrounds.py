"""The rounds of a ``StoreDistContext``: its collectives (``all_gather``, ``gather``, ``broadcast``, ``fence``)
and how a rank waits in one (rank 0 for every rank's key, the others for rank 0's verdict).

Moved out of ``dist.py``: ``dist.StoreDistContext`` inherits these methods from ``_StoreRounds`` (nobody else
uses the class); ``dist.py`` re-exports ``_store_errors``. Every rank calls the collectives in the same
order, from the training thread or a save thread (each on its channel, ``StoreDistContext.channel``); the
waits are ``distwait.wait_for``'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from .distpack import pack, published
from .distwait import default_timeout, wait_for
from .errors import RankFailureError, failure, failure_record, from_record


def _store_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``StoreDistContext`` collective: the store's own errors (``DistNetworkError``,
    ``DistStoreError``: RuntimeErrors; connection OSErrors) become a ``RankFailureError``."""

    @functools.wraps(fn)
    def wrapper(self: Any, tag: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, tag, *args, **kwargs)
        except RankFailureError:
            raise
        except (RuntimeError, OSError) as e:
            raise failure(
                f"{tag}: the c10d store stopped answering ({type(e).__name__}: {e}); the process hosting it "
                "(rank 0, or the launcher) died or hangs",
                {0: "the store it hosts is unreachable"},
            ) from e

    return wrapper


class _StoreRounds:
    """The collectives and waits of :class:`~trainguard.dist.StoreDistContext` (its only subclass), over its store, channel and rounds."""

    def _enter(self, tag: str, *, all_key: bool, per_rank: bool, value: Any = None) -> str:
        if self._new_op:  # the call's first round: a new operation (see operation())
            self._next_op()
        self._round += 1
        if self.rank == 0:  # the keys this round creates, for forget()
            self._keys[(self._op, self._round)] = (tag, all_key, per_rank)
        # Where this rank is now: lets the others tell "in another collective" or "left" from "not there yet";
        # a gather's answer (per_rank) after it, in the same multi_set (one store call a round, not two).
        at, base = (f"{self.chan}/at/{self.rank}", json.dumps([self._op, self._round, tag])), f"{self.chan}/r{self._op}.{self._round}/{tag}"
        self.store.multi_set([at[0], f"{base}/{self.rank}"], [at[1], json.dumps(value)]) if per_rank else self.store.set(*at)
        return base

    @_store_errors
    def all_gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any]:
        base = self._enter(tag, all_key=True, per_rank=True, value=value)
        if self.rank == 0:
            try:
                values = self._collect(base, tag, timeout)
            except RankFailureError as e:
                self._publish(f"{base}/all", failure_record(e))
                raise
            self._publish(f"{base}/all", {"packed": pack(values)})  # not O(world) bytes per rank (distpack)
            self.forget((self._op, self._round - 2))
            return values
        return self._await_root(f"{base}/all", tag, timeout)

    @_store_errors
    def gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any] | None:
        base = self._enter(tag, all_key=False, per_rank=True, value=value)
        if self.rank != 0:
            return None
        values = self._collect(base, tag, timeout)
        self.forget((self._op, self._round - 2))
        return values

    @_store_errors
    def broadcast(self, tag: str, value: Any = None, *, timeout: float | None = None) -> Any:
        base = self._enter(tag, all_key=True, per_rank=False)
        if self.rank == 0:
            self._publish(f"{base}/all", {"value": value})
            return value
        return self._await_root(f"{base}/all", tag, timeout)

    @_store_errors
    def fence(self, tag: str, claim: Any) -> Any:
        """The first ``claim`` made under ``tag`` by any rank (a compare-and-set): exactly one of
        rank 0's "I commit now" and another rank's "I gave up on rank 0" wins (``api``)."""
        key = f"{self.prefix}/fence/{tag}"
        if self.rank == 0:
            self._fences.append(((self._op, self._round), key))
        return json.loads(self.store.compare_set(key, "", json.dumps(claim)))

    def _publish(self, key: str, record: dict[str, Any]) -> None:
        """Rank 0: publish a round's result, unless a rank that gave up on rank 0 (``_await_root``)
        put its failure there first: then raise that failure, so every rank leaves this round."""
        mine = json.dumps(record)
        first = self.store.compare_set(key, "", mine).decode()
        if first != mine:
            out = json.loads(first)
            raise from_record(out)

    # -- waiting -----------------------------------------------------------------------------

    def _collect(self, base: str, tag: str, timeout: float | None) -> list[Any]:
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait_for(keys, list(range(self.world_size)), tag, timeout)
        raw = self.store.multi_get(keys)
        return [json.loads(v) for v in raw]

    def _await_root(self, key: str, tag: str, timeout: float | None) -> Any:
        # Rank 0 decides about the other ranks within ``timeout``; wait a little longer for its verdict.
        t = default_timeout() if timeout is None else timeout
        try:
            self._wait_for([key], [0], tag, t + self.dead_after + 5.0)
        except RankFailureError as e:
            # Leave the failure where rank 0 publishes: a rank 0 that was only stopped raises it in
            # this round when it resumes (``_publish``), not one round ahead of us for good.
            mine = json.dumps(failure_record(e))
            if self.store.compare_set(key, "", mine).decode() == mine:
                raise
        out = json.loads(self.store.get(key))  # {"value": v} or rank 0's failure record
        if "error" in out:
            raise from_record(out)
        return published(out)

    def _wait_for(self, keys: list[str], ranks: list[int], tag: str, timeout: float | None) -> None:
        """Wait until every key exists; ``ranks[i]`` is the rank that sets ``keys[i]`` (distwait.py)."""
        wait_for(self, keys, ranks, tag, default_timeout() if timeout is None else timeout)
