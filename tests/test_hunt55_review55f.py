"""Hostile review of async saving and the RAM tier (session 55, review55f)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import trainguard as tg
from test_ram17b_review import small_tmpfs  # noqa: F401  (a 4 MB tmpfs fixture, root only)
from test_storage_ram import _steps
from trainguard.tiers import ram_dir


def _events(root: str, kind: str) -> list[dict]:
    with open(os.path.join(root, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_that_grew_past_the_ram_tier_goes_to_the_run_directory(tmp_path, small_tmpfs, async_save):  # noqa: F811
    """Step 1 saves the model alone (2.4 MB: fits the 4 MB RAM tier); an optimizer is added to the
    state after it, and step 2 (model + Adam moments, 7.2 MB) no longer fits. The room was judged by
    step 1's size, so step 2 was written into RAM until ENOSPC: a sync save wrote it again to the run
    directory, but an async save failed, and the next ``wait()`` raised DiskFullError (with the
    default on_error="raise": the training run ended). Now the room is judged by the larger of the
    last checkpoint and the state's estimate: step 2 goes to the run directory, sync and async."""
    root, base = str(tmp_path / "run"), small_tmpfs
    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 600)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, async_save=async_save,
                              handle_signals=False) as mgr:
        mgr.save(1, {"model": model})
        mgr.wait()
        assert _steps(ram_dir(root, base)) == [1]
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 1000)).sum().backward()
        optim.step()
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mgr.save(2, {"model": model, "optim": optim})
        mgr.wait()
        assert mgr.latest_step() == 2
    assert _steps(root) == [1, 2]
    assert [e["step"] for e in _events(root, "save_failed")] == []
    assert [e["step"] for e in _events(root, "ram_no_room")] == [2]
    got = torch.nn.Linear(1000, 600)
    optim2 = torch.optim.Adam(got.parameters(), lr=0.1)
    with tg.CheckpointManager(root, handle_signals=False) as mgr:
        assert mgr.restore({"model": got, "optim": optim2}) == 2
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.items())
