"""Documentation claims of README.md, docs/checkpoints.md, docs/async.md, docs/storage.md,
docs/reliability.md and SECURITY.md checked against the code (session 41's docs audit)."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("async_save", [False, True])
def test_a_managers_save_of_a_step_an_earlier_run_left_says_to_restore_sync_and_async(tmp_path, async_save):
    """docs/checkpoints.md: without restore(), "a save of a step the directory already holds raises
    StepExistsError, saying to call mgr.restore(state, step=...) first". An async save met the step in
    its save thread and raised tg.save's own text ("pass overwrite=True", which a manager does not take)."""
    state = {"w": torch.arange(4.0)}
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    with pytest.raises(tg.StepExistsError) as caught:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=async_save, handle_signals=False) as mgr:
            mgr.save(2, state)
            mgr.wait()
    text = str(caught.value)
    assert "mgr.restore(state, step=...)" in text and "overwrite=True" not in text, text
    assert (root / "step-000000002" / "manifest.json").exists()
