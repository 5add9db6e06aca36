"""Feature combinations (review): promises that hold for each feature alone, checked where two
features meet. Two managers in one process (the model's and an EMA copy's) closed in the order
they were opened, and a mid-run rollback (``restore(state, step=N)``) under ``DalyInterval``."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

import trainguard as tg


def test_two_managers_closed_in_open_order_keep_signals_working(tmp_path: Path) -> None:
    # model manager opened first, EMA manager second, closed model-first (not LIFO): the open EMA
    # manager must still hear SIGTERM, and once both are closed the process's own handlers are back.
    calls: list[int] = []

    def orig(signum: int, frame: object) -> None:  # the process's handler before any manager
        calls.append(signum)

    before_term, before_int = signal.signal(signal.SIGTERM, orig), signal.getsignal(signal.SIGINT)
    try:
        state = {"model": torch.nn.Linear(2, 2)}
        model_mgr = tg.CheckpointManager(tmp_path / "model", save=tg.EveryNSteps(100)).open()
        ema_mgr = tg.CheckpointManager(tmp_path / "ema", save=tg.EveryNSteps(100)).open()
        model_mgr.close()
        assert signal.getsignal(signal.SIGTERM) == ema_mgr._on_signal  # still the open manager's
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what a SIGTERM runs now
        assert ema_mgr.save(1, state) is not None and ema_mgr.should_stop  # a preemption save
        ema_mgr.close()
        assert signal.getsignal(signal.SIGTERM) == orig  # not the closed model manager's handler
        assert signal.getsignal(signal.SIGINT) == before_int  # Ctrl-C interrupts again
        assert (tmp_path / "ema" / "step-000000001" / "manifest.json").exists()
    finally:
        signal.signal(signal.SIGTERM, before_term)
        signal.signal(signal.SIGINT, before_int)


class _PinnedDaly(tg.DalyInterval):
    """DalyInterval with fixed measurements (this machine's timing out of the test): Daly's
    interval for a 0.01 s stall and a 1 h MTBF is 8 steps of 1 s, clamped to max_steps=5."""

    def measurements(self) -> dict[str, float | None]:
        return {"stall_s": 0.01, "duration_s": 0.01, "step_time_s": 1.0}


def test_daly_interval_saves_again_after_a_mid_run_rollback(tmp_path: Path) -> None:
    policy = _PinnedDaly(node_mtbf_s=3600.0, initial_steps=5, min_steps=5, max_steps=5)
    state = {"model": torch.nn.Linear(2, 2), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(tmp_path / "run", save=policy, keep=tg.KeepAll(), handle_signals=False) as mgr:
        first = [s for s in range(1, 31) if mgr.save(s, state) is not None]
        assert first == [6, 11, 16, 21, 26]
        assert mgr.restore(state, step=14) == 11  # roll back past a loss spike, mid-run
        again = [s for s in range(12, 31) if mgr.save(s, state) is not None]
    # every 5 steps from the rollback on, as after a restart; it was [] (next save at step 31)
    assert again == [17, 22, 27]
