"""Error and concurrency paths of the save/commit machinery (session 41's review of commit.py,
async_save.py, handle.py, dist.py, api.py), each forced deterministically (Event gates, no sleeps)."""

from __future__ import annotations

import threading

import pytest
import torch

import trainguard as tg
from trainguard import async_save


def test_a_save_that_commits_as_the_managers_wait_runs_out_is_not_reported_failed(tmp_path, monkeypatch):
    """``SaveHandle.result_bounded`` waited with ``result(timeout)`` and took the TimeoutError of a wait that
    ran out as the save's own error when the save was done by the time it looked: a save that committed just
    as one of its 5 s waits ended was raised by ``mgr.wait()`` as "background save of step 1 failed: save of
    step 1 not finished after 5.0 s", and the manager forgot it (``last_saved_step`` stayed None)."""
    gate = threading.Event()
    real = async_save.persist_and_commit

    def gated(*args, **kwargs):
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_save, "persist_and_commit", gated)

    class RunsOutAsTheSaveEnds(threading.Event):
        def wait(self, timeout=None):
            if timeout is None or self.is_set():
                return super().wait(timeout)
            gate.set()  # the save thread finishes now ...
            super().wait(30)
            return False  # ... but this wait had run out first

    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        h = mgr.save(1, {"w": torch.arange(4.0)})
        h._done.__class__ = RunsOutAsTheSaveEnds
        mgr.wait()
        assert mgr.last_saved_step == 1
        assert h.done() and h.exception() is None
    assert (root / "step-000000001" / "manifest.json").exists()


def test_a_saves_own_timeout_error_is_still_raised_by_the_managers_wait(tmp_path, monkeypatch):
    """The other half of the above: a save that failed with a TimeoutError of its own (a socket's, an
    object store's) is raised by ``mgr.wait()`` as that save's failure, not taken for a wait that ran out."""

    def times_out(*args, **kwargs):
        raise TimeoutError("the store did not answer (the save's own)")

    monkeypatch.setattr(async_save, "persist_and_commit", times_out)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        h = mgr.save(1, {"w": torch.arange(4.0)})
        try:
            mgr.wait()
        except tg.CheckpointError as e:
            assert "the save's own" in str(e), e
        else:
            raise AssertionError("the save's TimeoutError was not raised")
        assert mgr.last_saved_step is None and isinstance(h.exception(), TimeoutError)


def test_a_ctrl_c_while_the_pool_hands_out_slots_does_not_leave_it_held(tmp_path, monkeypatch):
    """``StagingPool.acquire`` marked the pool held before it built the slot list (one view per tensor
    copied in the call), outside ``start_async_save``'s try that releases it: a Ctrl-C caught there left
    the process's pool held for good, and every later async save failed with "the staging pool is held
    by a save still in flight"."""
    from trainguard import stage

    monkeypatch.setattr(stage, "_DEFAULT", {})  # this test's pools only

    class CtrlCInEmpty:  # stage's torch: the Ctrl-C lands as acquire() makes the slot of an empty tensor
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *args, **kwargs):
            if args and args[0] == 0:
                raise KeyboardInterrupt
            return torch.empty(*args, **kwargs)

    state = {"a": torch.arange(4.0), "z": torch.empty(0)}
    with monkeypatch.context() as m:
        m.setattr(stage, "torch", CtrlCInEmpty())
        with pytest.raises(KeyboardInterrupt):
            tg.save(tmp_path / "one", state, async_=True)
    assert not stage.default_pool().in_use
    tg.save(tmp_path / "two", state, async_=True).result()
    assert (tmp_path / "two" / "manifest.json").exists()


def test_a_ctrl_c_as_the_save_goes_in_flight_does_not_leave_an_unstarted_save_there(tmp_path, monkeypatch):
    """``start_async_save`` put its job in flight (``_INFLIGHT``) before the try that takes it out again
    when no thread starts: a Ctrl-C as that ``with _LOCK:`` block exited (a call: Python looks at its signals
    there) left a save that never runs in flight, its pool held: the caller's next ``optimizer.step()``
    waited for its staging for good (the pre-step hook), and the next async save failed ("the staging pool
    is held")."""
    from trainguard import stage

    monkeypatch.setattr(stage, "_DEFAULT", {})  # this test's pools only
    monkeypatch.setattr(async_save, "_INFLIGHT", None)  # put back after the test, whatever it left
    real = async_save._LOCK

    class CtrlCOnExit:
        armed = True

        def __enter__(self):
            real.acquire()

        def __exit__(self, *exc):
            real.release()
            job = async_save._INFLIGHT
            if self.armed and job is not None and job.began is False:  # the new save's, not yet started
                self.armed = False
                raise KeyboardInterrupt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    with monkeypatch.context() as m:
        m.setattr(async_save, "_LOCK", CtrlCOnExit())
        with pytest.raises(KeyboardInterrupt):
            tg.save(tmp_path / "one", state, async_=True)
    job = async_save._INFLIGHT
    assert job is None or job.handle.staged(), "a save that never runs is in flight: optimizer.step() would wait for good"
    assert not stage.default_pool().in_use
    opt.step()
    tg.save(tmp_path / "two", state, async_=True).result()
    assert (tmp_path / "two" / "manifest.json").exists()


def test_close_keeps_releasing_the_run_lock_when_another_threads_save_takes_the_pool(tmp_path, monkeypatch):
    """``stage.trim_idle_pools`` (an async manager's ``close()``, last) looked at ``in_use`` and then called
    ``trim()``, which raises for a held pool: a direct async ``tg.save`` of another thread taking the pool
    in between made ``close()`` raise "cannot trim the staging pool while a save holds it" from its
    ``finally``, before the run lock was released: the directory stayed locked by a closed manager."""
    from trainguard import stage

    monkeypatch.setattr(stage, "_DEFAULT", {})  # this test's pools only
    root = tmp_path / "run"
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    mgr.save(1, {"w": torch.arange(4.0)})
    real = stage.StagingPool.trim

    def trim(self):  # another thread's save takes the pool right after trim_idle_pools looked at it
        t = threading.Thread(target=self.acquire, args=([],))
        t.start()
        t.join()
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(stage.StagingPool, "trim", trim)
        mgr.close()
    assert mgr.latest_step() == 1
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as again:  # not locked any more
        assert again.latest_step() == 1
