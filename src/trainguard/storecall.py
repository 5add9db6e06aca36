"""``BoundedStore``: c10d store calls that give up after a bound (``dist.StoreDistContext``'s store).

A ``TCPStore`` client whose server is *frozen* (the process hosting it SIGSTOPped, or its node
hung; with ``env://`` rendezvous that is rank 0) does not fail: every call blocks until the
server answers again, past the store's own timeout (torch 2.13: ``add``, ``check`` and ``get``
blocked for more than 55 s on a client created with a 5 s timeout). trainguard's collectives
wait by polling (``check``), so every one of its store calls should take milliseconds.

So each call runs on one worker thread per store and the caller waits for it at most ``bound``
seconds (``TRAINGUARD_DEAD_AFTER``, the time after which a silent rank is declared dead), then
raises :class:`StoreStalled`, which the collectives turn into a ``RankFailureError`` on every
waiting rank. The call itself cannot be interrupted: it stays on the worker (a daemon thread)
until the server answers or its connection breaks; calls queued behind it that nobody waits
for any more are dropped, not sent late. The heartbeat thread uses the raw store (``raw``): it
may block there, but its rank must not stop beating because the store was slow.

Best-effort calls (:meth:`BoundedStore.hasty`: the "left" mark of a rank raising out of an operation,
``note_busy``, ``CheckpointManager.close()``'s round) raise at once while the worker is still inside a call
a caller gave up on (they are queued behind it: none can be answered first). Before, each waited the whole
bound: a save on a frozen store host raised after 2 x ``TRAINGUARD_DEAD_AFTER`` (its wait's ``check``,
then the "left" mark), and the manager's ``close()`` waited once more. Other calls still wait their bound
(a host that resumes within it answers them: the next save goes on; a commit's fence sees the claim).

Rank 0 deletes the keys of finished rounds with :meth:`BoundedStore.discard`: the worker
deletes them one by one when no call is waiting, so the collectives never wait for the
cleanup (``world_size + 1`` keys per round; ~30-110 us a delete on loopback here).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any


class StoreStalled(RuntimeError):
    """A store call did not return within the bound (a RuntimeError, like the store's own errors)."""


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error", "dropped")

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.dropped = False


_WAKE = _Call(None, ())  # wakes the worker for keys to discard; a close()'s stop is another _Call(None, ())


class BoundedStore:
    """The store methods trainguard uses, each bounded by ``bound`` seconds (any thread may call)."""

    def __init__(self, store: Any, bound: float) -> None:
        self.raw = store
        self.bound = bound
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None  # set by _put, cleared by the worker itself as it ends
        self._stop_at: _Call | None = None  # the stop item of the last close(); a later call cancels it
        self._discard: collections.deque[str] = collections.deque()  # keys to delete when idle
        self._busy_since: float | None = None  # when the worker's store call in progress started (None: idle)
        self._item, self._stuck = 0, -1  # the worker's calls begun; the one a caller gave up on (it is still in it)
        self._local = threading.local()  # .hasty: this thread is in hasty()

    def _put(self, call: _Call) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="trainguard-store", daemon=True)
                self._worker.start()
            self._stop_at = None  # a call after close(): the worker stays for it (one worker per store, always)
            self._calls.put(call)

    def _call(self, name: str, *args: Any) -> Any:
        return self._wait(_Call(getattr(self.raw, name), args), name)

    @contextlib.contextmanager
    def hasty(self) -> Iterator[None]:
        """This thread's calls in the block are best-effort: they raise ``StoreStalled`` at once, not after the
        bound, while the worker is still in a call a caller gave up on (``dist.operation``'s "left" mark, ...)."""
        was, self._local.hasty = getattr(self._local, "hasty", False), True
        try:
            yield
        finally:
            self._local.hasty = was

    def _wait(self, call: _Call, name: str) -> Any:
        since = self._busy_since
        if getattr(self._local, "hasty", False) and since is not None and self._stuck == self._item:
            raise StoreStalled(  # queued behind a call that already stalled a caller: no wait
                f"the store did not answer {name}: its previous call has not returned for "
                f"{time.monotonic() - since:.0f} s (its host is frozen or unreachable)"
            )
        self._put(call)
        if not call.done.wait(self.bound):
            if self._busy_since is not None:
                self._stuck = self._item  # the worker's call in progress: later calls need not wait for it
            call.dropped = True  # not sent at all if it is still queued
            raise StoreStalled(
                f"the store did not answer {name} within {self.bound:.0f} s (its host is frozen or unreachable)"
            )
        if call.error is not None:
            raise call.error
        return call.result

    def discard(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` in the background: the worker deletes one whenever no call is queued;
        nobody waits for it, errors are ignored (rank 0's cleanup of finished rounds)."""
        self._discard.extend(keys)
        self._put(_WAKE)

    def drain(self) -> None:
        """Wait (at most the bound) until every key passed to :meth:`discard` is deleted."""
        self._wait(_Call(self._delete_discarded, ()), "delete_key")

    def _delete_discarded(self) -> None:
        while self._discard:
            self._delete_one()

    def _delete_one(self) -> None:
        self._item, self._busy_since = self._item + 1, time.monotonic()
        try:
            self.raw.delete_key(self._discard.popleft())
        except Exception:
            pass  # the store is going away: nothing left to clean
        finally:
            self._busy_since = None

    def close(self, wait: float = 0.0) -> None:
        """Let the worker end once it has run what is queued and deleted what was discarded; a later call
        keeps it (or, once it ended, starts another: never two at once); with ``wait``, join it for at most
        that many seconds (``dist``'s exit hook: a delete still inside the C++ store during finalization
        aborted the process). Before, a call after ``close()`` started a second worker on the same queue
        while the first was still in a store call: either took the stop, and ``close(wait)`` joined the one
        that had ended while the other was still inside the store."""
        with self._lock:
            worker = self._worker
            if worker is not None:
                self._stop_at = stop = _Call(None, ())
                self._calls.put(stop)
        if worker is not None and wait > 0:
            worker.join(wait)

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(block=not self._discard)
            except queue.Empty:  # nothing waiting: delete one discarded key, then look again
                self._delete_one()
                continue
            if call.fn is None and call is not _WAKE:  # a close()'s stop
                if call is not self._stop_at:
                    continue  # a call came after that close(), or a later close() queued its own
                self._delete_discarded()
                with self._lock:
                    if call is self._stop_at:  # no call since: end (the next _put starts another)
                        self._stop_at = self._worker = None
                        return
                continue
            if call is _WAKE or call.dropped:
                continue
            self._item, self._busy_since = self._item + 1, time.monotonic()
            try:
                call.result = call.fn(*call.args)
            except BaseException as e:  # handed to the caller
                call.error = e
            finally:
                self._busy_since = None
            call.done.set()

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        """One call setting ``keys`` in order (c10d's ``Store.multi_set``: TCPStore sends them in one request,
        PrefixStore passes it on, the base class sets them one by one); a store object without it: ``set`` each."""
        self._wait(_Call(self._multi_set, (keys, values)), "multi_set")

    def _multi_set(self, keys: list[str], values: list[str]) -> None:
        fn = getattr(self.raw, "multi_set", None)
        if fn is not None:
            return fn(keys, values)
        for k, v in zip(keys, values, strict=True):
            self.raw.set(k, v)
        return None

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)
