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
    # room for none beside it: 4096 bytes free while the RAM tier holds a copy, else its real free space
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: free._replace(free=4096 if _steps(ram) else free.free))
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


def _run(root: str, base: str, restore_at: int | None, saves: dict[int, float], *, persist: bool = True) -> float:
    """One incarnation of the job on the node whose RAM tier is under ``base``: restore (at or
    before ``restore_at``), save ``saves`` (step: fill value), then die keeping its RAM tier
    (``persist=False``: killed before the last save's copy to disk). Returns the fill restored."""
    m = _model(-1.0)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), ram_tier=base,
                               handle_signals=False).open()
    mgr.restore({"model": m}, step=restore_at)
    for step, fill in saves.items():
        if not persist and step == max(saves):
            mgr.ram.persist = lambda s: (_ for _ in ()).throw(OSError(5, "killed"))  # type: ignore[method-assign]
        mgr.save(step, {"model": _model(fill)})
    try:
        mgr.close(keep_ram_tier=True)
    except tg.CheckpointError:
        assert not persist
    return float(m.weight.detach()[0, 0])


@pytest.mark.parametrize("node_b_saves", [{30: -30.0}, {25: -25.0}, {}])
def test_a_ram_copy_the_run_directory_went_past_on_another_node_is_not_restored(tmp_path, node_b_saves):
    """Node A saved steps 10, 20, 30 and died; the job, requeued on node B, rolled back to step 20
    (a loss spike) and saved step 30 again, or step 25 (A's step 30, abandoned, is then removed
    from disk), or the user deleted step 30 by hand (no save); requeued on A again, the restart
    must resume from the run directory's timeline. Before, A's RAM copy of step 30 was restored:
    over B's step 30, or past B's step 25 and the step 20 the user went back to."""
    root, node_a, node_b = str(tmp_path / "run"), str(tmp_path / "shmA"), str(tmp_path / "shmB")
    os.makedirs(node_a)
    os.makedirs(node_b)
    _run(root, node_a, None, {10: 10.0, 20: 20.0, 30: 30.0})
    if node_b_saves:
        assert _run(root, node_b, 20, node_b_saves) == 20.0
    else:
        shutil.rmtree(os.path.join(root, "step-000000030"))
    newest = max(node_b_saves, default=20)
    assert _steps(ram_dir(root, node_a)) == [30] and _steps(root)[-1] == newest
    assert _run(root, node_a, None, {}) == node_b_saves.get(newest, 20.0)  # before: 30.0, A's abandoned step 30
    assert _steps(ram_dir(root, node_a)) == []  # discarded


def test_a_ram_copy_saved_again_after_a_rollback_is_still_restored(tmp_path):
    """The limit of the rule above: after a rollback on this node, this run saves step 3 again
    (its old copy on disk is removed first) and is killed before the copy to disk; the new RAM
    copy of step 3 is the newest checkpoint and is restored, not taken for the old one."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _run(root, base, None, {1: 1.0, 2: 2.0, 3: 3.0})
    _run(root, base, 2, {3: 33.0}, persist=False)
    assert _steps(root) == [1, 2]
    assert _run(root, base, None, {}) == 33.0
    assert _steps(root) == [1, 2, 3]  # restored from RAM, copied to disk


class _Select(tg.RetentionPolicy):
    reads_metadata = False

    def __init__(self, select) -> None:  # noqa: ANN001
        self._select = select

    def select(self, checkpoints):  # noqa: ANN001, ANN201
        return self._select(checkpoints)


@pytest.mark.parametrize("wrong", [
    lambda cps: {str(c.step) for c in cps},  # steps parsed from directory names, left as strings
    lambda cps: set(torch.tensor([c.step for c in cps])),  # 0-d tensors: hashed by identity
])
def test_a_retention_policy_returning_anything_but_steps_deletes_nothing(tmp_path, wrong):
    """A user policy meant to keep everything returns its steps as strings (or tensors). Before, no
    step matched and retention deleted every checkpoint but the newest; now it fails, warns and
    keeps them all (as for a policy that raises)."""
    root = str(tmp_path / "run")
    with pytest.warns(UserWarning, match="retention after step 2 failed.*must return the steps"):
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=_Select(wrong), handle_signals=False) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"model": _model(float(step))})
    assert _steps(root) == [1, 2, 3]  # before: [3]
    ok = _Select(lambda cps: {float(c.step) for c in cps if c.step != 1})  # numbers of any kind still count
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=ok, handle_signals=False) as mgr:
        mgr.save(4, {"model": _model(4.0)})
    assert _steps(root) == [2, 3, 4]


def test_ls_and_verify_do_not_offer_a_stale_ram_copy_as_a_resume_point(tmp_path):
    """``trainguard ls`` said of the RAM copy that the restart discards (step 30, deleted from the
    run directory by hand after it reached it) "in RAM only: a restart on this node resumes from
    them", and ``verify`` of a run directory without a valid checkpoint named it too."""
    from click.testing import CliRunner

    from trainguard.cli import main

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _run(root, base, None, {30: 30.0})
    shutil.rmtree(os.path.join(root, "step-000000030"))
    for args in (["ls", root], ["verify", root]):
        r = CliRunner().invoke(main, [*args, "--ram-tier", base])
        assert "in RAM only" not in r.output and "holds a valid copy" not in r.output, r.output
    assert "stale in RAM" in CliRunner().invoke(main, ["ls", root, "--ram-tier", base]).output
    assert _run(root, base, None, {}) == -1.0  # what they say: nothing to resume from (a fresh start)


def test_a_good_ram_copy_is_restored_over_its_step_whose_manifest_rotted_on_disk(tmp_path):
    """The limit of the rule that discards a RAM copy whose step the run directory holds with
    another manifest: a manifest that differs because it is corrupt on disk (a flipped byte) is no
    other run's checkpoint; the good RAM copy of that step is restored, not step 2."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _run(root, base, None, {1: 1.0, 2: 2.0, 3: 3.0})
    path = os.path.join(root, "step-000000003", "manifest.json")
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    assert _run(root, base, None, {}) == 3.0


def _two_rank_job(rank: int, world: int, root: str, base: str, at: int | None, saves: list) -> tuple:
    """A 2-rank incarnation (async saves through the RAM tier under ``base``) that restores, saves
    ``saves`` and dies keeping its RAM tier; returns (step restored, value restored)."""
    w = {"w": torch.full((7,), -1.0)}
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=base, async_save=True,
                               handle_signals=False, timeout=30).open()
    got = mgr.restore({"model": w}, step=at)
    for step, v in saves:
        mgr.save(step, {"model": {"w": torch.full((7,), float(v))}})
    mgr.close(keep_ram_tier=True)
    return got, float(w["w"][0])


def test_two_ranks_async_a_rollback_on_another_node_is_not_undone_by_this_nodes_ram_copy(tmp_path):
    """The node-B rollback above with 2 gloo ranks and async saves: every rank restores B's step 3."""
    from dist_helper import run_ranks

    root, node_a, node_b = str(tmp_path / "run"), str(tmp_path / "shmA"), str(tmp_path / "shmB")
    os.makedirs(node_a)
    os.makedirs(node_b)
    run_ranks(_two_rank_job, 2, root, node_a, None, [(1, 1), (2, 2), (3, 3)], timeout=60)
    assert [r.value for r in run_ranks(_two_rank_job, 2, root, node_b, 2, [(3, -3)], timeout=60)] == [(2, 2.0)] * 2
    assert [r.value for r in run_ranks(_two_rank_job, 2, root, node_a, None, [], timeout=60)] == [(3, -3.0)] * 2
