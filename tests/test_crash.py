"""A hard crash at each named point of the save path leaves the last good checkpoint.

Each crash ends a process of its own, forked by ``conftest.forked`` (torch imported once)."""

from __future__ import annotations

import os

import pytest
import torch

import trainguard as tg
from trainguard.faults import POINTS
from trainguard.inspect import list_checkpoints

from conftest import TESTS
from crashlib import state_for

COMMITTED_AFTER = {"after_rename", "before_retention"}


def _assert_state(state, step):
    want = state_for(step)
    assert state["progress"]["step"] == step
    assert torch.equal(state["model"].weight, want["model"].weight)
    assert torch.equal(state["data"]["big"], want["data"]["big"])
    assert all(torch.equal(a, b) for a, b in zip(state["data"]["small"], want["data"]["small"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_named_point_leaves_last_good_checkpoint(tmp_path, forked, point, mode):
    root = tmp_path / "run"
    log = tmp_path / "child.log"
    code = forked(TESTS / "crashlib.py", root, point, "exit", mode, log=log)
    assert code == 17, (code, log.read_text())
    expect = 2 if point in COMMITTED_AFTER else 1
    rows = list_checkpoints(root)
    assert [x.step for x in rows if x.status == "valid"][-1] == expect
    for x in rows:
        if x.status == "valid":
            assert tg.verify(x.path).ok
    state = state_for(99)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        # The new manager cleaned what the crash left: no temp dirs, no manifest-less step dirs.
        names = os.listdir(root)
        assert not [n for n in names if ".tmp-" in n or ".old-" in n], names
        assert all(x.status == "valid" for x in list_checkpoints(root))
        assert mgr.restore(state) == expect
    _assert_state(state, expect)
