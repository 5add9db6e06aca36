"""Retention and the RAM tier when things go wrong (review 17): a RAM tier with room for one
checkpoint after a restart whose restore did not load its RAM copy."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import trainguard as tg
from test_ram_health_review import _crashed_run, _flip_a_byte
from test_storage_ram import _model, _steps
from trainguard import streams, tiers
from trainguard.tiers import ram_dir


@pytest.mark.parametrize("how", ["rollback", "corrupt_ram_only"])
def test_a_ram_tier_with_room_for_one_drops_the_copy_restore_went_behind(tmp_path, monkeypatch, how):
    """The RAM copy of step 3 is not loaded by the restart's restore: a rollback to step 2, or a
    RAM-only copy (its copy to disk never finished) that is corrupt. Before, ``make_room`` dropped
    only a copy this process had copied to disk, so on a tmpfs with room for one checkpoint
    every save of the restarted run failed with ENOSPC (seen with a 2 MB tmpfs and a 1 MB model)."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _crashed_run(root, base, (1, 2, 3))
    ram = ram_dir(root, base)
    if how == "corrupt_ram_only":
        shutil.rmtree(os.path.join(root, "step-000000003"))  # killed during its copy to disk
        _flip_a_byte(os.path.join(ram, "step-000000003"))
    seen: list[list[int]] = []  # committed RAM steps when each save starts writing its data
    monkeypatch.setattr(streams, "fault", lambda point, rank: seen.append(_steps(ram)) if point == "write_begin" else None)
    free = shutil.disk_usage(base)
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: free._replace(free=4096))  # room for none beside it
    m = _model(0.0)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=base,
                              handle_signals=False) as mgr:
        assert mgr.restore({"model": m}, step=2 if how == "rollback" else None) == 2
        assert torch.all(m.weight == 2)
        mgr.save(3, {"model": _model(30.0)})
        assert seen == [[]]  # before: [[3]], the old step 3 still filled the RAM tier
        mgr.ram.wait()
        assert _steps(ram) == [3] and _steps(root) == [2, 3]
    m = _model(0.0)
    with tg.CheckpointManager(root, handle_signals=False) as mgr:
        assert mgr.restore({"model": m}) == 3 and torch.all(m.weight == 30)  # this run's step 3


def test_a_ram_copy_that_failed_to_reach_disk_is_not_dropped_for_room(tmp_path, monkeypatch):
    """The fix's limit: a copy this run saved after its restore, whose copy to disk failed, is the
    only copy of its step and is not dropped by the next save's ``make_room``."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _crashed_run(root, base, (1, 2, 3))
    ram = ram_dir(root, base)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=base,
                              handle_signals=False) as mgr:
        assert mgr.restore({"model": _model(0.0)}, step=2) == 2
        monkeypatch.setattr(mgr.ram, "persist", lambda step: (_ for _ in ()).throw(OSError(28, "disk full")))
        mgr.save(3, {"model": _model(30.0)})
        mgr.ram.wait()
        monkeypatch.undo()
        free = shutil.disk_usage(base)
        monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: free._replace(free=4096))
        mgr.ram.make_room()
        assert _steps(ram) == [3]  # kept: not on disk
        with pytest.raises(tg.CheckpointError, match="disk full"):
            mgr.close(keep_ram_tier=True)
