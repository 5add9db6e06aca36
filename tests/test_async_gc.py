"""An async save keeps Python's cyclic collector paused from its call until its thread ends
(gcpause.hold): the tracked objects it builds per tensor live through the write, and young
collections meanwhile promoted them all to the oldest generation, which made CPython run a full
collection (~130 ms here) every 7-20 saves (1,264 and 632 tensors: python -m bench.gc_full).
The hold is bounded in time, ends when a write is found stuck and in a forked child, and leaves
a collector the user turned off turned off."""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

import trainguard as tg
from trainguard import gcpause
from trainguard.errors import CheckpointError, UnsupportedValueError

from conftest import held_pwrite


@pytest.fixture(autouse=True)
def _collector_on():
    assert gc.isenabled()
    yield
    gc.enable()  # whatever a failing test left


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def _churn() -> list:
    """Tracked objects enough for dozens of young collections (threshold 700) with the collector on."""
    return [[i] for i in range(30_000)]


def test_no_collection_runs_while_an_async_save_is_in_flight_and_the_collector_resumes_after(tmp_path, gate):
    state = _state()
    runs: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        h = tg.save(tmp_path / "c", state, async_=True)
        keep = _churn()  # the training thread allocates while the save is in flight
        assert not h.done() and not gc.isenabled()
        assert runs == []  # before: dozens of young collections, promoting the save's objects
        gate.set()
        h.result()
        assert gc.isenabled()
        del keep
        _churn()
        assert runs  # collections run again once the save ended
    finally:
        gc.callbacks.remove(seen)


def test_a_hold_past_its_time_ends_at_the_next_optimizer_step(tmp_path, monkeypatch, gate):
    # A save stuck in a write must not keep the collector off: the optimizer pre-step hook ends
    # a hold older than gcpause.ASYNC_HOLD_S (0 here: expired at once).
    monkeypatch.setattr(gcpause, "ASYNC_HOLD_S", 0.0)
    state = _state()
    h = tg.save(tmp_path / "c", state, async_=True)
    assert not gc.isenabled()
    other = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1)  # not in the state: its step does not wait for the save
    other(torch.randn(1, 2)).sum().backward()
    sgd.step()
    assert gc.isenabled() and not h.done()
    gate.set()
    h.result()
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(tmp_path):
    gc.disable()
    try:
        tg.save(tmp_path / "c", _state(), async_=True).result()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_save_refused_in_its_call_or_failing_in_its_thread_releases_the_collector(tmp_path, monkeypatch):
    state = _state()
    with pytest.raises(UnsupportedValueError):
        tg.save(tmp_path / "bad", {**state, "x": object()}, async_=True)
    assert gc.isenabled() and not gcpause._held
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_fsync")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    h = tg.save(tmp_path / "c", state, async_=True)
    with pytest.raises(CheckpointError, match="injected failure at before_fsync"):
        h.result()
    assert gc.isenabled() and not gcpause._held


def _report(q) -> None:
    q.put(gc.isenabled())


def test_a_process_forked_during_the_save_runs_with_the_collector_on(tmp_path, gate):
    state = _state()
    h = tg.save(tmp_path / "c", state, async_=True)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_report, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) is True  # the child has no save thread to end the hold
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
        gate.set()
    h.result()
    assert gc.isenabled()


def test_holds_nest_with_pauses_and_end_once():
    a = gcpause.hold(60)
    with gcpause.gc_paused():
        b = gcpause.hold(60)
        gcpause.release(a)
        gcpause.release(a)  # twice: nothing more
        assert not gc.isenabled()
    assert not gc.isenabled()  # b still holds it
    gcpause.release(b)
    assert gc.isenabled()


def test_a_save_found_stuck_in_a_write_releases_the_collector(tmp_path, monkeypatch):
    # Its thread may never end: once a wait says StuckWriteError, the collector runs again.
    from trainguard import StuckWriteError

    entered, release = held_pwrite(monkeypatch, str(tmp_path / "c"))
    try:
        state = _state()
        h = tg.save(tmp_path / "c", state, async_=True, timeout=0.5)
        assert entered.wait(60) and not gc.isenabled()
        with pytest.raises(StuckWriteError):
            tg.save(tmp_path / "d", state, async_=True, timeout=0.5)  # waits for the previous save first
        assert gc.isenabled() and not h.done()
    finally:
        release.set()
    h.join()
    assert gc.isenabled()
