"""``CheckpointManager.save(force=...)`` and ``close(keep_ram_tier=...)`` take True or False only:
``force="no"`` saved a step the policy did not ask for, ``keep_ram_tier="no"`` kept the RAM copies
in /dev/shm after a clean close."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import trainguard as tg


def test_save_refuses_a_force_that_is_not_a_bool_and_saves_nothing(tmp_path: Path) -> None:
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(100), handle_signals=False) as mgr:
        with pytest.raises(TypeError, match=r"force='no': pass True or False"):
            mgr.save(1, {"progress": tg.StateDict(step=1)}, force="no")
        assert mgr.save(2, {"progress": tg.StateDict(step=2)}, force=False) is None
        assert mgr.save(3, {"progress": tg.StateDict(step=3)}, force=1) is not None  # 0 and 1 are bools enough
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("step-")) == ["step-000000003"]


def test_close_refuses_a_keep_ram_tier_that_is_not_a_bool_then_closes_cleanly(tmp_path: Path) -> None:
    mgr = tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), ram_tier=True, handle_signals=False).open()
    try:
        mgr.save(1, {"progress": tg.StateDict(step=1)})
        ram = mgr.ram.dir
        with pytest.raises(TypeError, match=r"keep_ram_tier='no': pass True or False"):
            mgr.close(keep_ram_tier="no")
        assert os.path.isdir(ram)  # nothing was done: still open, its RAM copy kept
    finally:
        mgr.close()
    assert not os.path.exists(ram)  # the clean close removed it
