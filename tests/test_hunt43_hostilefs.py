"""Hunt 43 (hostile file systems and paths): regressions found by running trainguard on paths and
directories that are not a plain ext4 directory of the user's own."""

from __future__ import annotations

import os

import torch

import trainguard as tg


def _state(v: float = 1.0) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "progress": tg.StateDict(step=0)}


def test_dotdot_after_a_symlink_resolves_as_the_kernel_does(tmp_path):
    """``link/../run`` with ``link`` a symbolic link names the run in the link target's parent (``ls``,
    ``cp``, ``torch.save`` of that path), but ``os.path.abspath`` dropped ``link/..`` by the letters:
    trainguard wrote the checkpoints into the working directory instead, maybe on another file system."""
    real = tmp_path / "lustre" / "user"
    real.mkdir(parents=True)
    work = tmp_path / "home"
    work.mkdir()
    (work / "scratch").symlink_to(real)
    run = os.path.join(str(work / "scratch"), "..", "run")
    one = os.path.join(str(work / "scratch"), "..", "one")
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
    tg.save(one, _state(2.0))
    torch.save({"x": 1}, os.path.join(str(work / "scratch"), "..", "torch.pt"))
    # Where the kernel puts `scratch/..`: next to torch.save's file, not in the directory holding the link.
    assert sorted(os.listdir(tmp_path / "lustre")) == ["one", "run", "torch.pt", "user"]
    assert sorted(os.listdir(work)) == ["scratch"]
    assert tg.verify(os.path.join(run, "step-000000001")).ok
    dst = _state(0.0)
    tg.load(one, dst)
    assert torch.equal(dst["model"]["w"], torch.full((64,), 2.0))
    fresh = _state(0.0)
    with tg.CheckpointManager(tmp_path / "lustre" / "run", handle_signals=False) as mgr:
        assert mgr.restore(fresh) == 1
    assert torch.equal(fresh["model"]["w"], torch.full((64,), 1.0))
