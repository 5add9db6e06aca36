"""Review of the manager's save policies, retention and signal handling: one test per bug found."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.policies import CheckpointInfo


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit())


@pytest.mark.parametrize("mode, bad", [("min", -math.inf), ("max", math.inf), ("min", math.inf), ("max", -math.inf)])
def test_keep_best_ranks_infinite_metrics_last_in_either_mode(tmp_path, mode, bad):
    # docs/checkpoints.md: "nan and ±inf included: KeepBest ranks them last". A loss of -inf
    # (mode="min") or an accuracy of +inf (mode="max") ranked first and was kept forever.
    good = [0.5, 0.3, 0.2] if mode == "min" else [0.5, 0.6, 0.7]
    infos = [CheckpointInfo(1, 0.0, {"m": bad})] + [CheckpointInfo(s, 0.0, {"m": v}) for s, v in enumerate(good, 2)]
    assert tg.KeepBest("m", n=1, mode=mode).select(infos) == {4}
    assert tg.KeepBest("m", n=3, mode=mode).select(infos) == {2, 3, 4}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepBest("m", n=1, mode=mode),
                              handle_signals=False) as mgr:
        for step, v in enumerate([bad, *good], 1):
            mgr.save(step, {"w": torch.zeros(2)}, metrics={"m": v})
    assert _steps(tmp_path) == [3, 4]  # and the one before the newest (retention.py: the newest is the best)


def test_a_rollback_in_the_same_process_replaces_and_removes_this_managers_newer_steps(tmp_path):
    # restore(state, step=N) mid-run (an automatic rollback past a loss spike): the steps this
    # manager saved after N are an abandoned timeline like an earlier run's. They were still
    # counted as its own: the save of step 6 raised StepExistsError ("pass overwrite=True", which
    # save() does not take), and 8 and 10 would have been kept and resumed from at the next start.
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(2), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        for step in range(1, 11):
            state["w"].fill_(step)
            mgr.save(step, state)
        assert _steps(tmp_path) == [2, 4, 6, 8, 10]
        assert mgr.restore(state, step=5) == 4 and state["w"][0].item() == 4.0
        for step in range(5, 8):
            state["w"].fill_(100 + step)
            assert (mgr.save(step, state) is not None) == (step == 6)
        assert _steps(tmp_path) == [2, 4, 6]  # 6 replaced; 8 and 10 removed
    with tg.CheckpointManager(tmp_path, handle_signals=False) as mgr:
        assert mgr.restore(state) == 6 and state["w"][0].item() == 106.0


def test_sigterm_reaches_every_open_manager_not_only_the_one_opened_last(tmp_path):
    # Two managers open in one process (the model's and an EMA copy's): the second one's open()
    # replaced the first one's handler, so SIGTERM set only the second one's flag and the first
    # neither saved at its next save() nor set should_stop.
    state = {"w": torch.zeros(4)}
    before = signal.getsignal(signal.SIGTERM)
    with tg.CheckpointManager(tmp_path / "main", save=tg.EveryNSteps(100)) as main:
        with tg.CheckpointManager(tmp_path / "ema", save=tg.EveryNSteps(100)) as ema:
            assert main.save(1, state) is None and ema.save(1, state) is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert main.save(2, state) is not None and main.should_stop
            assert ema.save(2, state) is not None and ema.should_stop
        assert signal.getsignal(signal.SIGTERM) == main._on_signal
    assert signal.getsignal(signal.SIGTERM) is before
    assert _steps(tmp_path / "main") == [2] and _steps(tmp_path / "ema") == [2]


def _signal_on_rank1_group(rank: int, world: int, root: str) -> dict:
    import signal as _signal

    import trainguard as _tg

    state = {"w": torch.arange(4.0)}
    saved, stopped = [], None
    with _tg.CheckpointManager(f"{root}/run", save=_tg.EveryNSteps(1000), timeout=30) as mgr:
        for step in range(1, 9):
            if step == 3 and rank == 1:
                os.kill(os.getpid(), _signal.SIGTERM)  # only this rank's node is reclaimed
            if mgr.save(step, state) is not None:
                saved.append(step)
            if mgr.should_stop:
                stopped = step
                break
            torch.distributed.barrier()  # the step's gradient all-reduce: ranks stay within a step
    return {"saved": saved, "stopped": stopped}


def test_a_preemption_signal_on_another_rank_than_0_saves_and_stops_every_rank(tmp_path):
    # Rank 0 alone decided whether to save for preemption, from its own flag: a SIGTERM that
    # reached only another rank (its node reclaimed) was never acted on. Heard one step late at
    # most (rank 0 may have decided that step already).
    from dist_helper import run_ranks

    out = [r.value for r in run_ranks(_signal_on_rank1_group, 2, str(tmp_path), timeout=90)]
    assert out[0] == out[1], out  # the same decision on every rank
    assert out[0]["stopped"] in (3, 4) and out[0]["saved"] == [out[0]["stopped"]], out


def test_keepbest_ranks_an_int_past_float_range_last(tmp_path):
    """``metrics={"loss": 10**400}`` (an int no float holds) made every later retention fail with
    "int too large to convert to float": old checkpoints piled up, one warning per save."""
    import warnings

    import trainguard as tg

    m = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tg.CheckpointManager(tmp_path, keep=tg.KeepBest("loss", n=1), async_save=False) as mgr:
            for step, loss in ((1, 10**400), (2, 1.0), (3, 2.0)):
                mgr.save(step, {"m": m}, metrics={"loss": loss}, force=True)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000002", "step-000000003"]  # the best, and the newest (never deleted)
