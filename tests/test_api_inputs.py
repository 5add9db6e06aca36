"""Wrong inputs to the public API give a clear error that says what to change (a
``CheckpointError``, ``ValueError`` or ``TypeError``), at the call that got them: not an
AttributeError from deep inside, not a hang of the other ranks, not silent acceptance that
fails much later (at the first resume, or when the world size grows).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import reliability

from dist_helper import run_ranks


def _saved(tmp_path: Path) -> str:
    path = str(tmp_path / "ck" / "step-000000001")
    tg.save(path, {"model": nn.Linear(2, 2)})
    return path


def test_load_and_restore_refuse_a_state_that_is_not_a_dict(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(tg.UnsupportedValueError, match="dict of named entries"):
        tg.load(path, [nn.Linear(2, 2)])  # type: ignore[arg-type]
    with tg.CheckpointManager(tmp_path / "fresh", handle_signals=False) as mgr:
        # A fresh start reads nothing, but the mistake must show now, not at the first resume.
        with pytest.raises(tg.UnsupportedValueError, match="dict of named entries"):
            mgr.restore(None)  # type: ignore[arg-type]


def test_manager_save_refuses_a_step_that_is_not_an_int(tmp_path: Path) -> None:
    state = {"model": nn.Linear(2, 2)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for bad in ("5", None, 1.5, True):
            with pytest.raises(TypeError, match="pass the training step as an int"):
                mgr.save(bad, state)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="int >= 0"):
            mgr.save(-1, state, force=True)
        with pytest.raises(tg.UnsupportedValueError, match="dict of names to numbers"):
            mgr.save(1, state, metrics=[0.5])  # type: ignore[arg-type]
        assert mgr.save(torch.tensor(2), state) is not None  # a 0-d integer tensor is a step
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")] == ["step-000000002"]


def test_manager_open_on_a_file_raises_a_checkpoint_error(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(tg.CheckpointError, match="pass a directory path"):
        tg.CheckpointManager(f, handle_signals=False).open()


def _open_file_root(rank: int, world: int, root: str) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        tg.CheckpointManager(root, handle_signals=False, timeout=60).open()
    except tg.CheckpointError as e:
        return type(e).__name__, time.monotonic() - t0
    return "opened", time.monotonic() - t0


def test_manager_open_on_a_file_fails_on_every_rank_without_waiting(tmp_path: Path) -> None:
    # Rank 0's OSError used to escape before the "open" broadcast: rank 1 waited out the timeout.
    f = tmp_path / "afile"
    f.write_text("x")
    results = run_ranks(_open_file_root, 2, str(f), timeout=120)
    assert [r.value[0] for r in results] == ["CheckpointError", "CheckpointError"], [r.error for r in results]
    # Timed in each rank (the ranks' start is no part of it): at once, not after the 60 s timeout.
    assert all(r.value[1] < 30 for r in results), [r.value for r in results]


def test_samplers_refuse_negative_counts_and_bad_ranks() -> None:
    s = tg.ResumableSampler(10, shuffle=False)
    with pytest.raises(ValueError, match="int >= 0"):
        s.advance(-3)  # used to move the position back: 13 samples in a 10-sample epoch
    with pytest.raises(TypeError, match="int >= 0"):
        s.advance(2.7)  # used to be truncated silently
    with pytest.raises(ValueError, match="epochs count from 0"):
        s.set_epoch(-1)  # used to be saved, then refused as corrupt at resume
    assert s.position == 0 and s.epoch == 0
    with pytest.raises(ValueError, match="rank=3, world_size=2"):
        tg.ResumableSampler(10, rank=3, world_size=2)  # at construction, not at the first __iter__
    it = tg.ResumableIterable(lambda epoch: range(5))
    with pytest.raises(ValueError, match="int >= 0"):
        it.advance(-1)


def test_policies_and_rng_state_check_their_arguments() -> None:
    with pytest.raises(TypeError, match="reseed"):
        tg.RNGState(reseed="a")  # type: ignore[arg-type]  # used to fail only when the world grew
    with pytest.raises(TypeError, match="name the metric"):
        tg.KeepBest(5)  # type: ignore[arg-type]  # never matched a metric: kept the newest instead
    with pytest.raises(TypeError, match="combine retention policies"):
        tg.KeepLatest(3) | 5  # type: ignore[operator]  # used to fail at every retention, on rank 0
    with pytest.raises(ValueError, match="a number > 0"):
        tg.EverySeconds("10")  # type: ignore[arg-type]
    assert tg.RNGState(reseed=7).reseed == 7
    assert isinstance(tg.KeepLatest(3) | tg.KeepEvery(10), tg.RetentionPolicy)


def test_doctor_refuses_arguments_it_would_silently_ignore() -> None:
    state = {"model": nn.Linear(2, 2)}
    with pytest.raises(TypeError, match="CheckpointManager or a dict"):
        tg.doctor(state, "ckpts", source=None)
    with pytest.raises(TypeError, match="make_plan"):
        tg.doctor(state, plan=5, source=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="amp='fp8'"):
        tg.doctor(state, amp="fp8", source=None)


def test_reliability_formulas_refuse_impossible_inputs() -> None:
    with pytest.raises(ValueError, match="mtbf_s=0"):
        reliability.optimal_interval(1.0, 0.0)  # was a ZeroDivisionError
    with pytest.raises(ValueError, match="mtbf_s=-5"):
        reliability.daly_interval(1.0, -5.0)  # was a negative interval
    with pytest.raises(ValueError, match="stall_s=-1"):
        reliability.young_interval(-1.0, 10.0)  # was "math domain error"
    with pytest.raises(ValueError, match="runs must be an int >= 1"):
        reliability.simulate(interval_s=10, stall_s=1, restart_s=1, mtbf_s=100, runs=0)  # was nan
    with pytest.raises(ValueError, match="intervals="):
        reliability.make_plan(nodes=1, stall_s=1, restart_s=1, node_mtbf_s=100, intervals={"x": -10.0})
    assert reliability.daly_interval(0.0, 100.0) == 0.0  # a zero stall stays allowed (DalyInterval)


def test_timeouts_must_be_positive_seconds(tmp_path: Path) -> None:
    # Accepted silently before; a distributed run then failed every collective at once, or
    # deep inside the store with a str.
    path = _saved(tmp_path)
    for bad in (-1, 0, "10"):
        with pytest.raises(ValueError, match="seconds > 0"):
            tg.CheckpointManager(tmp_path / "m", timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seconds > 0"):
            tg.save(tmp_path / "s" / "step-000000002", {"model": nn.Linear(2, 2)}, timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seconds > 0"):
            tg.load(path, {"model": nn.Linear(2, 2)}, timeout=bad)  # type: ignore[arg-type]
    tg.load(path, {"model": nn.Linear(2, 2)}, timeout=5)


def test_save_metadata_must_be_a_dict(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="metadata=\\[1, 2\\]: pass a dict"):  # was dict()'s own message
        tg.save(tmp_path / "step-000000001", {"model": nn.Linear(2, 2)}, metadata=[1, 2])  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())
