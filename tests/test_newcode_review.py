"""Review of the code added in the last hours (rollback set-aside, sampler, report, retention facts,
imports): each test failed before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainguard as tg
from test_rollback_crash import _first_run, _resume, _steps


def test_a_second_rollback_after_a_failed_first_save_keeps_the_abandoned_steps_aside(tmp_path, monkeypatch):
    """restore(step=2), save(3) fails (steps 3-5 set aside under a token), restore(step=2) again,
    save(3) commits. Before: the second restore dropped the token, so that commit did not carry it,
    steps 4 and 5 stayed aside, and the next open put them back: the restart resumed from step 5,
    the timeline rolled back from twice."""
    root = tmp_path / "run"
    _first_run(root)
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False, on_error="warn") as mgr:
        assert mgr.restore(state, step=2) == 2
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_manifest")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        with pytest.warns(UserWarning, match="save of step 3 failed"):
            assert mgr.save(3, state) is None
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        assert mgr.restore(state, step=2) == 2
        state["w"].fill_(30.0)
        mgr.save(3, state)
        assert _steps(root) == ["step-000000001", "step-000000002", "step-000000003"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no debris to clean either
        assert _resume(root) == (3, 30.0)
    assert _steps(root) == ["step-000000001", "step-000000002", "step-000000003"]
