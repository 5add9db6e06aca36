"""The RAM tier when the RAM copy of a step is corrupt and its durable copy good: restore uses
the durable copy, the step counts as usable, and only the bad RAM copy is discarded."""

from __future__ import annotations

import os

import torch

import trainguard as tg
from test_storage_ram import _model, _steps
from trainguard.tiers import ram_dir


def _flip_a_byte(step_dir: str) -> None:
    with open(os.path.join(step_dir, "data-00000.bin"), "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0xFF]))


def _crashed_run(root: str, base: str, steps: tuple[int, ...]) -> None:
    """A run that saved ``steps`` (each copied to disk) and died: its RAM copy of the last stays."""
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), ram_tier=base, handle_signals=False)
    with mgr:
        for step in steps:
            mgr.save(step, {"model": _model(float(step))})
        mgr.ram.wait()
        mgr.close(keep_ram_tier=True)
    assert _steps(root) == list(steps) and _steps(ram_dir(root, base)) == [steps[-1]]


def test_a_good_durable_copy_restored_after_its_corrupt_ram_copy_counts_as_usable(tmp_path):
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _crashed_run(root, base, (1, 2, 3))
    ram = ram_dir(root, base)
    _flip_a_byte(os.path.join(ram, "step-000000003"))
    m = _model(0.0)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=base,
                              handle_signals=False) as mgr:
        assert mgr.restore({"model": m}) == 3  # the durable copy
        assert torch.all(m.weight == 3)
        assert _steps(ram) == []  # the bad RAM copy is discarded
        assert mgr.save(3, {"model": m}) is None  # saved already; before: its durable copy was deleted and saved again
        assert _steps(root) == [1, 2, 3]
        mgr.save(4, {"model": _model(4.0)})
        mgr.ram.wait()
        assert _steps(root) == [3, 4]  # before: [2, 4], step 3 took no place among those kept
