"""Session 21 review (area "left"): the RAM tier's latest_step, shared JSON values that differ
between ranks, module-level state that grows with the number of saves."""

from __future__ import annotations

import threading

import torch

import trainguard as tg
from trainguard import tiers


def test_latest_step_counts_the_ram_tier_copy_still_on_its_way_to_disk(tmp_path, monkeypatch):
    """A save into the RAM tier is committed there (wait() returned, restore resumes from it) while
    rank 0 copies it to the run directory in the background: latest_step() gave the step before
    (None after the first save) until that copy ended. The copy is held here until checked."""
    go = threading.Event()
    real = tiers.fault

    def hold(point: str, rank: int = 0) -> None:
        if point == "before_persist":
            assert go.wait(30)
        real(point, rank)

    monkeypatch.setattr(tiers, "fault", hold)
    ram = tmp_path / "ram"
    ram.mkdir()
    root = str(tmp_path / "run")
    m = torch.nn.Linear(8, 4)
    with tg.CheckpointManager(root, ram_tier=str(ram)) as mgr:
        try:
            for step in (1, 2):
                mgr.save(step, {"m": m}, force=True)
                mgr.wait()
                assert mgr.latest_step() == step  # before: None, then 1 (the copy held)
                go.set()
                mgr.ram.wait()
                go.clear()
                assert mgr.latest_step() == step
        finally:
            go.set()  # close() waits for the copy
    with tg.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 2
