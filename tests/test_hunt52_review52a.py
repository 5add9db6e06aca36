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


def test_calls_behind_a_stalled_one_fail_at_once_not_after_the_bound_each() -> None:
    """A store host frozen mid-round (SIGSTOP of the process hosting the TCPStore; 3 gloo ranks,
    TRAINGUARD_DEAD_AFTER=3): a save raised after 6-9 s, 2-3 x the bound, and the manager's close()
    waited 3 s more, as each later call (the "left" mark, the close round's multi_set) waited its own
    whole bound behind the first, which the worker was still stuck in. Now they raise at once."""
    raw = _FrozenHost()
    store = BoundedStore(raw, 0.2)
    try:
        with pytest.raises(StoreStalled, match="did not answer check within"):
            store.check(["k"])
        store.bound = 60.0  # a later call that waited its bound would not end within the join below
        t, out = _in_thread(lambda: store.set("at", "left"))
        t.join(10)
        assert not t.is_alive(), "set() waited behind the stalled check"
        assert isinstance(out.get("error"), StoreStalled), out
        assert "its previous call has not returned" in str(out["error"])
    finally:
        raw.resume.set()
    assert raw.sent == ["check"]  # the set was never sent, not even once the host resumed


def test_a_commit_fence_behind_a_stalled_call_still_waits_for_a_host_that_resumes() -> None:
    """``compare_set`` (the commit's fence, ``commitfence.abandon_commit``) keeps its whole bound: a rank 0
    that resumes within it sees the claim and commits nothing."""
    raw = _FrozenHost()
    store = BoundedStore(raw, 0.2)
    try:
        with pytest.raises(StoreStalled):
            store.check(["k"])
        store.bound = 30.0
        t, out = _in_thread(lambda: store.compare_set("fence", "", "claim"))
        for _ in range(1000):  # bounded: until the fence is queued behind the stuck check
            if store._calls.qsize():
                break
            threading.Event().wait(0.01)
        assert store._calls.qsize() == 1
    finally:
        raw.resume.set()
    t.join(10)
    assert out == {"result": b"claim"}, out
    assert raw.sent == ["check", "compare_set"]
