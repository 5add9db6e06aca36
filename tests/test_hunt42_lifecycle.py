"""A CheckpointManager misused or stressed over its lifecycle (hunt 42, "lifecycle"): bad input
gets a clear error that says what to change, and nothing is lost.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch import nn

import trainguard as tg
from trainguard.permanent import is_permanent


def test_a_manager_pointed_at_one_checkpoint_is_refused_and_leaves_it_untouched(tmp_path: Path) -> None:
    # Before: open() put .lock and events.jsonl into step-000000007, restore() returned None (a fresh
    # start over the checkpoint the run meant to resume from) and save(8) nested step-000000008 in it.
    root = tmp_path / "run1"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(7, {"model": nn.Linear(2, 2)})
    step_dir = root / "step-000000007"
    before = sorted(os.listdir(step_dir))
    mgr = tg.CheckpointManager(step_dir, save=tg.EveryNSteps(1), handle_signals=False)
    with pytest.raises(tg.CheckpointError, match="is one checkpoint \\(step 7\\), not a run directory") as err:
        mgr.open()
    assert str(root) in str(err.value) and "tg.load(" in str(err.value)  # what to pass instead
    assert is_permanent(err.value)  # `trainguard run` does not restart into it (exit 78)
    assert sorted(os.listdir(step_dir)) == before  # no lock, no event log, nothing nested
    with tg.CheckpointManager(root, handle_signals=False) as mgr:  # the run directory is not locked by it
        assert mgr.restore({"model": nn.Linear(2, 2)}) == 7
