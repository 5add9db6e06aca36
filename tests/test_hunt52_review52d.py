"""Session 52's hunt for data loss in checkpoint retention (review52d): each test holds a
behaviour that was wrong before."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from tests.dist_helper import run_ranks

import trainguard as tg


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and "." not in n)


def test_a_second_manager_of_this_process_on_the_same_run_directory_through_another_path_is_refused(tmp_path: Path) -> None:
    """Two managers of one process on one run directory, the second through another path (reproduced
    with ``mount --bind``: ``/data/run`` and ``/mnt/run``; here the lock file hard-linked into another
    directory, which needs no privilege: the same inode under another real path). ``RunLock.acquire``
    refused a second manager by the lock file's real path only, and POSIX locks of one process do not
    conflict: the second opened, and its retention (``KeepLatest(2)``, no ``restore``) deleted the
    first one's step 10; the first one's next save then failed, saying its lock was held by "another
    job" (its own pid). Now the second ``open`` is refused before anything is removed."""
    run, other = tmp_path / "run", tmp_path / "other"
    other.mkdir()
    t = torch.zeros(4)
    kw = dict(save=tg.EveryNSteps(5), keep=tg.KeepLatest(2), handle_signals=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(run, **kw) as a:
            a.save(10, {"t": t})
            a.save(20, {"t": t})
            os.link(run / ".lock", other / ".lock")  # `other` is `run` through another path, as far as the lock goes
            b = tg.CheckpointManager(other, **kw)
            with pytest.raises(tg.LockedError, match="another CheckpointManager in this process .*another path"):
                b.open()
            assert _steps(run) == [10, 20]
            a.save(30, {"t": t})  # the first manager still holds its lock: saves go on
            assert _steps(run) == [20, 30]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_copy_from_the_ram_tier_to_disk_is_raised_at_the_next_save(tmp_path: Path, monkeypatch, async_save: bool) -> None:
    """Reproduced with the run directory on a 1000 KiB tmpfs, 400 KB checkpoints, ``KeepLatest(2)`` and
    ``ram_tier=``: from step 3 on every copy to disk failed with ENOSPC (retention frees room only after a
    commit), yet every ``save()`` returned, with the default ``on_error="raise"``: the run went on with steps
    1 and 2 on disk and the newest step in RAM only (a lost node lost every step since). Without the RAM
    tier the save of step 3 raised ``DiskFullError``. Now, with ``on_error="raise"``, the next save raises
    the failed copy on every rank before it writes anything, and the RAM tier keeps the step whose copy
    failed (a restart on this node resumes from it); ``close()`` does not raise it a second time. With
    ``on_error="warn"`` the run goes on saving into RAM, as before. The copy fails here at the fault
    point ``before_persist``."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.zeros(4)
    kw = dict(save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=str(shm), async_save=async_save,
              handle_signals=False)
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_persist")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tg.CheckpointError, match="copying step-000000001 to .* failed: RuntimeError: injected"):
            with tg.CheckpointManager(root, **kw) as mgr:
                t.fill_(1)
                mgr.save(1, {"t": t})
                t.fill_(2)
                mgr.save(2, {"t": t})  # raised here: the copy of step 1 failed
        assert not (root / "step-000000001" / "manifest.json").exists()
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        with tg.CheckpointManager(root, **kw) as mgr:  # the same node: step 1 from the RAM tier, copied to disk
            assert mgr.restore({"t": t}) == 1 and t[0].item() == 1.0
            mgr.wait()
        assert (root / "step-000000001" / "manifest.json").exists()
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_persist")
        with tg.CheckpointManager(root, **{**kw, "on_error": "warn"}) as mgr:
            mgr.restore({"t": t})
            for s in (2, 3):
                t.fill_(s)
                assert mgr.save(s, {"t": t}) is not None  # warn: saved into RAM, the failed copies logged
            mgr.wait()
            assert mgr.latest_step() == 3
            with pytest.raises(tg.CheckpointError, match="RAM tier: copying to .* failed: injected"):
                mgr.close()  # as before: the last failed copy is raised by close()


def _ranks_save_while_copies_fail(rank: int, world: int, root: str, shm: str) -> str:
    t = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=shm,
                                      handle_signals=False, timeout=60) as mgr:
                mgr.save(1, {"t": t})
                mgr.save(2, {"t": t})
        except tg.CheckpointError as e:
            return str(e)
    return "returned"


def test_a_failed_copy_from_the_ram_tier_is_raised_on_every_rank_at_the_next_save(tmp_path: Path) -> None:
    """The same on 2 gloo ranks: rank 0's copy of step 1 to disk fails; the save of step 2 raises the
    same error on both ranks (rank 0 sends it in the save's "ram_room" round), none waits for the other.
    Before, both ranks' saves returned and only rank 0's ``close()`` raised."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"TRAINGUARD_CRASH_AT": "before_persist", "TRAINGUARD_CRASH_KIND": "raise", "TRAINGUARD_CRASH_RANK": "0"}
    out = [r.value for r in run_ranks(_ranks_save_while_copies_fail, 2, str(tmp_path / "run"), str(shm), env=env,
                                      timeout=120)]
    assert all("copying step-000000001 to" in v and "the save of step-000000002 was not made" in v for v in out), out
