"""Async saves and the CheckpointManager under failures found by a review: a save thread that
cannot start, a wait interrupted by Ctrl-C, close() from another thread. Every failed save leaves
the previous checkpoint loadable, no thread behind, no staging pool held, and step() free."""

from __future__ import annotations

import signal
import threading
import warnings

import pytest
import torch

import trainguard as tg
from trainguard import async_save, stage
from trainguard.errors import CheckpointError
from trainguard.handle import SaveHandle


@pytest.fixture(autouse=True)
def _own_async_state(monkeypatch):
    """Own process-wide staging pools; a save left in flight is finished before the next test."""
    monkeypatch.setattr(stage, "_DEFAULT", {})
    yield
    job = async_save._INFLIGHT
    if job is not None and job.handle._thread is not None and job.handle._thread.ident is not None:
        job.handle.join()


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optim)
    return {"model": model, "optim": optim}


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    optim.step()


def _values(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _loaded(path) -> dict[str, torch.Tensor]:
    got = _state()
    torch.nn.init.zeros_(got["model"].weight)
    tg.load(path, got)
    return _values(got)


def _no_save_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("trainguard-async-save")]


def _refuse_save_threads(monkeypatch, error: type[BaseException] = RuntimeError) -> None:
    real = threading.Thread.start

    def start(self):
        if self.name == "trainguard-async-save":
            raise error("can't start new thread")  # the thread limit of the process is reached (or Ctrl-C)
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_save_thread_that_cannot_start_releases_pool_and_step_and_next_save_works(tmp_path, monkeypatch):
    state = _state()
    tg.save(tmp_path / "a", state, async_=True).result(timeout=60)
    before = _values(state)
    _refuse_save_threads(monkeypatch)
    with pytest.raises(CheckpointError, match="could not start the async save thread"):
        tg.save(tmp_path / "b", state, async_=True)
    monkeypatch.undo()
    assert not stage.default_pool().in_use
    job = async_save._INFLIGHT
    assert job is None or job.handle.staged()  # else the optimizer's pre-step hook waits forever
    _step(state["model"], state["optim"])
    after = _values(state)
    tg.save(tmp_path / "c", state, async_=True).result(timeout=60)  # not refused, no join error
    assert all(torch.equal(a, b) for a, b in zip(_loaded(tmp_path / "a").values(), before.values()))
    assert all(torch.equal(a, b) for a, b in zip(_loaded(tmp_path / "c").values(), after.values()))
    assert _no_save_threads()


def test_ctrl_c_before_the_save_thread_starts_releases_pool_and_step(tmp_path, monkeypatch):
    # A KeyboardInterrupt between the save's registration as in flight and its thread's start left
    # the save in flight with no thread: the next optimizer.step() waited forever in the pre-step
    # hook, and every later async save failed joining a thread never started.
    state = _state()
    _refuse_save_threads(monkeypatch, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        tg.save(tmp_path / "b", state, async_=True)
    monkeypatch.undo()
    assert not stage.default_pool().in_use and async_save._INFLIGHT is None
    _step(state["model"], state["optim"])  # returns: nothing to wait for
    after = _values(state)
    tg.save(tmp_path / "c", state, async_=True).result(timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(_loaded(tmp_path / "c").values(), after.values()))
    assert _no_save_threads() and not (tmp_path / "b" / "manifest.json").exists()


def test_manager_with_on_error_warn_goes_on_when_the_save_thread_cannot_start(tmp_path, monkeypatch):
    state = _state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, on_error="warn",
                                  handle_signals=False) as mgr:
            mgr.save(1, state)
            mgr.wait()
            _refuse_save_threads(monkeypatch)
            assert mgr.save(2, state) is None  # reported as a failed save, training goes on
            monkeypatch.undo()
            _step(state["model"], state["optim"])
            assert mgr.save(3, state) is not None
    assert any("save of step 2 failed" in str(w.message) for w in caught)
    assert mgr.latest_step() == 3
    assert not stage.default_pool().in_use and _no_save_threads()


def _interrupt_waits(monkeypatch) -> threading.Event:
    """From now on a wait for a save still in flight is cut short by Ctrl-C (KeyboardInterrupt
    in the wait), and saves are held before their background copies until the returned event."""
    real = SaveHandle.result

    def result(self, timeout=None):
        if not self.done():
            raise KeyboardInterrupt
        return real(self, timeout)

    monkeypatch.setattr(SaveHandle, "result", result)
    gate = threading.Event()
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
    return gate


def test_close_after_a_wait_cut_short_by_ctrl_c_still_waits_and_raises_the_saves_error(tmp_path, monkeypatch):
    state = _state()
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    mgr.save(1, state)
    mgr.wait()
    gate = _interrupt_waits(monkeypatch)
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_fsync")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    h = mgr.save(2, state)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait()
    gate.set()
    h.join()  # the save failed in the background meanwhile
    with pytest.raises(CheckpointError, match="injected failure at before_fsync"):
        mgr.close()  # before: returned at once, the failure was never raised
    assert mgr.latest_step() == 1
    assert not stage.default_pool().in_use and _no_save_threads()


def test_save_after_a_wait_cut_short_by_ctrl_c_collects_the_save_in_flight(tmp_path, monkeypatch):
    state = _state()
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        gate = _interrupt_waits(monkeypatch)
        assert mgr.save(1, state) is not None
        with pytest.raises(KeyboardInterrupt):
            mgr.save(2, state)  # Ctrl-C while this save waits for the one in flight
        gate.set()
        monkeypatch.undo()  # waits are not interrupted any more
        assert mgr.save(2, state) is not None
        assert mgr.last_saved_step == 1  # step 1 was collected: committed, and known to the manager
    assert mgr.last_saved_step == 2 and mgr.latest_step() == 2


def test_close_from_another_thread_releases_the_run_dir_and_a_later_close_restores_the_handlers(tmp_path):
    state = _state()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True).open()  # main thread: handlers set
    assert mgr.save(1, state) is not None
    errors: list[BaseException] = []

    def close() -> None:
        try:
            mgr.close()  # waits for the save in flight
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=close)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "close() in another thread hung"
    assert not errors, errors  # before: ValueError (signal only works in main thread), run dir still locked
    assert mgr.latest_step() == 1 and _no_save_threads() and not stage.default_pool().in_use
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True) as again:  # not locked any more
        assert again.restore(state) == 1
    mgr.open()
    mgr.close()  # in the main thread: the handlers from before the first open() are back
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_restore_waits_for_the_save_in_flight_before_it_writes_into_the_state(tmp_path, monkeypatch):
    from trainguard import manager as manager_mod

    state = _state()
    gate = threading.Event()  # the save's background copies wait until someone waits for the save
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
    real_result, real_load = SaveHandle.result, manager_mod.load
    monkeypatch.setattr(SaveHandle, "result", lambda self, timeout=None: (gate.set(), real_result(self, timeout))[1])
    seen: list[bool] = []

    def load(*args, **kwargs):
        seen.append(h.done())  # before: restore() loaded while the save still copied the state
        gate.set()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(manager_mod, "load", load)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        at_save = _values(state)
        h = mgr.save(1, state)
        assert mgr.restore(state) == 1
        assert seen == [True]
    assert all(torch.equal(a, b) for a, b in zip(_loaded(tmp_path / "step-000000001").values(), at_save.values()))


def test_an_embedding_with_max_norm_is_copied_at_the_call(tmp_path, monkeypatch):
    # nn.Embedding(max_norm=...) renormalizes the rows it looks up inside forward(), outside
    # optimizer.step(): staged later like other parameters, the checkpoint held the rows as the
    # next forward rewrote them, not as they were at the save() call.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8, max_norm=1.0), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(10.0)  # every row longer than max_norm
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    gate = threading.Event()
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
    at_call = model[0].weight.detach().clone()
    h = tg.save(tmp_path / "c", state, async_=True)
    model(torch.arange(16)).sum().backward()  # the forward renormalizes every row in place
    assert not torch.equal(model[0].weight, at_call)
    gate.set()
    h.result(timeout=60)
    got = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 2))
    tg.load(tmp_path / "c", {"model": got}, only=["model"])
    assert torch.equal(got[0].weight, at_call)


def test_after_commit_runs_once_whether_the_save_committed_before_or_after():
    calls: list[object] = []
    early = SaveHandle(1)
    early.set_result("m1")  # the save thread won the race to the commit
    early.after_commit(calls.append)
    late = SaveHandle(2)
    late.after_commit(calls.append)
    assert calls == ["m1"]
    late.set_result("m2")
    failed = SaveHandle(3)
    failed.set_error(RuntimeError("x"))
    failed.after_commit(calls.append)
    assert calls == ["m1", "m2"]


def test_ram_tier_copy_starts_when_the_async_save_committed_before_the_manager_looked(tmp_path, monkeypatch):
    # The manager set its commit callback after the save call returned: a save that committed
    # first was copied to disk only when the manager collected it at the next save/wait/close.
    from trainguard import manager as manager_mod

    real = manager_mod.start_save

    def committed_first(*args, **kwargs):
        h = real(*args, **kwargs)
        h.join()  # the save thread commits before the manager gets the handle
        return h

    monkeypatch.setattr(manager_mod, "start_save", committed_first)
    state = _state()
    (tmp_path / "shm").mkdir()
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True, handle_signals=False,
                              ram_tier=str(tmp_path / "shm")) as mgr:
        assert mgr.save(1, state) is not None
        mgr.ram.wait()  # the copy to disk was started by the commit, not by a later call
        assert mgr.ram.persisted == 1
        assert (tmp_path / "run" / "step-000000001" / "manifest.json").exists()
