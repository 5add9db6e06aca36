"""Review of the new code in ranks, the manager and ``trainguard run`` (newcode16a): what a
late Ctrl-C, a rank's exit and the agent's signals left open. Bounded in time; gloo on 127.0.0.1."""

from __future__ import annotations

import json
import threading

import torch

import trainguard as tg
import trainguard.async_save as asv


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def _ctrl_c_after_the_save_thread_started(monkeypatch) -> None:  # noqa: ANN001
    real = threading.Thread.start

    def start_then_ctrl_c(self) -> None:  # noqa: ANN001
        real(self)
        if self.name == "trainguard-async-save":
            monkeypatch.setattr(threading.Thread, "start", real)
            while asv._INFLIGHT is not None and asv._INFLIGHT.began is False:  # until its thread owns the save
                threading.Event().wait(0.001)
            raise KeyboardInterrupt  # after start(), before the call returns

    monkeypatch.setattr(threading.Thread, "start", start_then_ctrl_c)


def test_a_managed_async_save_whose_call_a_late_ctrl_c_ended_is_still_the_managers(tmp_path, monkeypatch):
    # Before: the save thread committed step 1 but the manager never recorded it (no pending
    # handle): no 'save' event, last_saved_step None, step 1 not its own; a notebook re-running
    # the loop from step 1 then saved step 1 again, that save failed (StepExistsError) and the
    # next save(2) raised it: the run stopped.
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    assert mgr.restore(_state(0)) is None
    _ctrl_c_after_the_save_thread_started(monkeypatch)
    try:
        mgr.save(1, _state(1))
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:
        pass
    mgr.wait()  # the save the Ctrl-C left running
    assert mgr.last_saved_step == 1 and 1 in mgr._own
    assert mgr.save(1, _state(1)) is None  # the loop re-run from step 1: saved already
    assert mgr.save(2, _state(2)) is not None
    mgr.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in events if e["event"].startswith("save")] == [("save", 1), ("save", 2)]
    assert tg.CheckpointManager(tmp_path).latest_step() == 2
