"""Hostile review (session 52) of the multi-rank coordination code: distwait, distpack, dist, storecall."""

from __future__ import annotations

import threading

import pytest

from trainguard.storecall import BoundedStore, StoreStalled


class _FrozenHost:
    """A store whose host froze: every call blocks until ``resume`` is set (bounded by the test)."""

    def __init__(self) -> None:
        self.resume = threading.Event()
        self.sent: list[str] = []

    def _block(self, name: str) -> None:
        self.sent.append(name)
        assert self.resume.wait(30), "the test never resumed the host"

    def check(self, keys: list[str]) -> bool:
        self._block("check")
        return True

    def set(self, key: str, value: str) -> None:
        self._block("set")

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._block("compare_set")
        return desired.encode()


def _in_thread(fn):
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_best_effort_calls_behind_a_stalled_one_fail_at_once_not_after_the_bound_each() -> None:
    """A store host frozen mid-round (SIGSTOP of the process hosting the TCPStore; 3 gloo ranks,
    TRAINGUARD_DEAD_AFTER=3): a save raised after 6 s, 2 x the bound, as the "left" mark of ``dist.operation``
    waited its own whole bound behind the stalled ``check`` the worker was still in, and the manager's
    close() waited 3 s more. Best-effort calls (``hasty``) now raise at once; they were never sent."""
    raw = _FrozenHost()
    store = BoundedStore(raw, 0.2)
    try:
        with pytest.raises(StoreStalled, match="did not answer check within"):
            store.check(["k"])
        store.bound = 60.0  # a later call that waited its bound would not end within the join below

        def left() -> None:
            with store.hasty():
                store.set("at", "left")

        t, out = _in_thread(left)
        t.join(10)
        assert not t.is_alive(), "set() waited behind the stalled check"
        assert isinstance(out.get("error"), StoreStalled), out
        assert "its previous call has not returned" in str(out["error"])
    finally:
        raw.resume.set()
    assert raw.sent == ["check"]  # the set was never sent, not even once the host resumed


@pytest.mark.parametrize("call", ["set", "compare_set"])
def test_other_calls_behind_a_stalled_one_still_wait_for_a_host_that_resumes(call: str) -> None:
    """A save's own calls (the next save's first ``set``; ``compare_set``, the commit's fence) keep their whole
    bound: a store host frozen for 5 s with TRAINGUARD_DEAD_AFTER=3 failed one save, and the next, made at once,
    went on once the host resumed (failing them at once too failed that next save on every rank)."""
    raw = _FrozenHost()
    store = BoundedStore(raw, 0.2)
    try:
        with pytest.raises(StoreStalled):
            store.check(["k"])
        store.bound = 30.0
        args = ("at", "x") if call == "set" else ("fence", "", "claim")
        t, out = _in_thread(lambda: getattr(store, call)(*args))
        for _ in range(1000):  # bounded: until the call is queued behind the stuck check
            if store._calls.qsize():
                break
            threading.Event().wait(0.01)
        assert store._calls.qsize() == 1
    finally:
        raw.resume.set()
    t.join(10)
    assert out == {"result": b"claim" if call == "compare_set" else None}, out
    assert raw.sent == ["check", call]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class _NeverStore:
    """Rank 0's view of a round where rank 1 never comes (its heartbeat beats); no "at" keys."""

    def check(self, keys: list[str]) -> bool:
        return all(k == "k/0" or "/hb/" in k for k in keys)

    def add(self, key: str, n: int) -> int:
        return 1

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [b"1" for _ in keys]


class _Ctx:
    dead_after, prefix, chan, _op, _round, _parent = 10.0, "p", "c", 1, 1, None

    def __init__(self) -> None:
        self.store, self.rank, self.world_size = _NeverStore(), 0, 2


@pytest.mark.parametrize("timeout", [0.5, 2.5, 7.2])
def test_a_timeout_raises_at_its_deadline_not_at_the_next_look(monkeypatch: pytest.MonkeyPatch, timeout: float) -> None:
    """The timeout was only checked at the once-a-second looks: ``timeout=2.5`` raised after 3 s, ``0.5``
    after 1 s (a simulated clock), and the message said "within 0 s" and "within 2 s". Now a look comes at the
    deadline too, and the message gives the timeout as passed."""
    from trainguard import distwait
    from trainguard.errors import RankFailureError

    clock = _Clock()
    monkeypatch.setattr(distwait, "time", clock)
    with pytest.raises(RankFailureError, match="did not arrive") as e:
        distwait.wait_for(_Ctx(), ["k/0", "k/1"], [0, 1], "begin", timeout)
    assert timeout <= clock.now <= timeout + 0.01, clock.now
    assert f"did not arrive within {timeout:g} s" in str(e.value)  # was "within 0 s" for 0.5, "within 2 s" for 2.5
