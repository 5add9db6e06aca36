"""Adversarial review of the day's new code (newcode14): system-call errors on the RAM tier's
paths, the one-thread guard, and the other new modules."""

from __future__ import annotations

import os

import pytest

import trainguard as tg
from test_syscall_review import Inject, assert_holds, blank, state_for


def test_ram_tier_save_whose_durable_stat_fails_is_a_checkpoint_error_and_warn_continues(tmp_path):
    """LocalStorage.exists raises EIO/EACCES since 5ae2281. The RAM tier's preflight (rank 0, every
    save: is the step already committed on disk?) let it out bare: ``mgr.save`` raised OSError
    through ``on_error="warn"`` on rank 0 alone (the other ranks waited in the save's first round)."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False, ram_tier=str(ram)) as mgr:
        mgr.save(1, state_for(1))
        with Inject({"stat": 1}, match="step-000000002/manifest.json") as inj, pytest.warns(UserWarning, match="Input/output"):
            assert mgr.save(2, state_for(2)) is None  # warned, training goes on
        assert inj.hits == ["stat"]
        mgr.save(3, state_for(3))
    assert_holds(run / "step-000000003", 3)


def test_ram_tier_replacing_a_step_whose_stat_fails_is_a_checkpoint_error(tmp_path):
    """The same for the removal of a durable copy a rolled-back save replaces (manager.save, rank 0,
    RAM tier or object store): its stat's EIO escaped ``on_error="warn"`` as a bare OSError."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False, ram_tier=str(ram)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), on_error="warn",
                              handle_signals=False, ram_tier=str(ram)) as mgr:
        assert mgr.restore(blank(), step=1) == 1
        with Inject({"stat": 1}, match="step-000000002/manifest.json") as inj, pytest.warns(UserWarning, match="Input/output"):
            assert mgr.save(2, state_for(2)) is None
        assert inj.hits == ["stat"]
        mgr.save(2, state_for(22))  # the retry replaces it
    st = blank()
    tg.load(run / "step-000000002", st)
    assert st["progress"]["step"] == 22
    assert os.path.isdir(run / "step-000000001")
