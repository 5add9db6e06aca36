"""What a direct async save's ``handle.call_s`` counts, and who runs first when its thread starts.

Before, ``call_s`` (the stall a direct ``tg.save(..., async_=True)`` logs and ``trainguard bench``
reports) was taken before the save thread was started: the ``thread.start()`` and the end of the
call were not in it. That start cost up to a switch interval (5 ms) more: the new thread took the
snapshot and ran on holding the GIL while the training thread waited to return. Seen as
``trainguard bench``'s stall (call_s + step wait) 9 ms below the call timed from outside
(tests/test_selfbench.py, under a loaded machine). Now the thread waits until ``start()`` has
returned, and ``call_s`` is the whole call. The clock here is a fake one: no timing."""

from __future__ import annotations

import threading
import time
import types

import torch

import trainguard as tg
from trainguard import api, async_save


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def test_call_s_counts_the_threads_start_and_the_thread_waits_until_start_returned(tmp_path, monkeypatch):
    clock = [1000.0]
    seen_at_start: list[bool] = []

    class SlowStart(threading.Thread):
        def start(self) -> None:
            super().start()
            clock[0] += 10.0  # what start() took, by the fake clock
            if self.name == "trainguard-async-save":
                boxed = self._args[3]  # type: ignore[attr-defined]  # _run's [snapshot]
                seen_at_start.append(bool(boxed))  # _run has not taken it yet: it waits for go

    fake_threading = types.SimpleNamespace(**{**vars(threading), "Thread": SlowStart})
    fake_time = types.SimpleNamespace(**{**vars(time), "monotonic": lambda: clock[0]})  # api.start_save times the call
    monkeypatch.setattr(async_save, "threading", fake_threading)
    monkeypatch.setattr(api, "time", fake_time)
    state = _state()
    want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    h = tg.save(tmp_path / "c", state, async_=True)
    assert h.call_s >= 10.0  # before: 0.0, taken before the start
    assert seen_at_start == [True]
    h.result(timeout=60)
    with torch.no_grad():
        state["model"].weight.zero_()
    tg.load(tmp_path / "c", state)
    assert all(torch.equal(state["model"].state_dict()[k], v) for k, v in want.items())
