"""Session 41's hunt in the RAM tier and retention policies (ramret): each test holds a
behaviour that was wrong before."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and "." not in n
                  and (root / n / "manifest.json").exists())


def _refuse_removing(monkeypatch, mgr: tg.CheckpointManager, name: str) -> None:
    """The RAM tier's removal of its copy ``name`` fails with EACCES (others are removed)."""
    real = mgr.ram.storage.remove_tree

    def refused(path: str) -> None:
        if path.endswith(name):
            raise PermissionError(13, "Permission denied", path)
        real(path)

    monkeypatch.setattr(mgr.ram.storage, "remove_tree", refused)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_saved_again_after_a_rollback_reaches_disk_through_the_ram_tier(tmp_path: Path, async_save: bool) -> None:
    """Save steps 1..6 through the RAM tier, roll back to 5 with ``restore(step=5)``, save step 6
    again: that save must be copied to the run directory. Before, ``RamTier.committed`` remembered
    step 6 from the first timeline and took the new step 6's commit for the second call of an async
    save: no copy to disk, no retention; the rollback had removed the old step 6 from disk, and the
    clean ``close`` removed the RAM tier, so the new step 6 was lost (a restart resumed from 5)."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.zeros(1)
    kw = dict(save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), ram_tier=str(shm), async_save=async_save)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(root, **kw) as mgr:
            for s in range(1, 7):
                t.fill_(s)
                mgr.save(s, {"t": t})
            assert mgr.restore({"t": t}, step=5) == 5
            t.fill_(66)
            mgr.save(6, {"t": t})
            mgr.wait()
        assert _steps(root) == [2, 3, 4, 5, 6]
        got = torch.zeros(1)
        tg.load(str(root / "step-000000006"), {"t": got})
        assert got.item() == 66.0
        with tg.CheckpointManager(root, **kw) as mgr:
            assert mgr.restore({"t": got}) == 6 and got.item() == 66.0


def test_a_step_saved_again_after_a_rollback_whose_copy_failed_is_not_dropped_for_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 1..3 through the RAM tier (3 copied to disk), ``restore(step=2)``, save step 3 again,
    its copy to disk fails: that RAM copy is the only one of the new step 3 (the rollback removed
    the old one from disk), and the next save's ``make_room`` must keep it, short of room or not.
    Before, ``RamTier.persisted`` still named step 3 of the first timeline, and ``make_room`` took
    the new copy for the one already on disk and removed it: the step was gone everywhere."""
    from trainguard import tiers

    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=str(shm),
                                   handle_signals=False).open()
        for s in (1, 2, 3):
            t.fill_(s)
            mgr.save(s, {"t": t})
        assert mgr.restore({"t": t}, step=2) == 2
        monkeypatch.setattr(mgr.ram, "persist", lambda step: (_ for _ in ()).throw(OSError(28, "disk full")))
        t.fill_(33)
        mgr.save(3, {"t": t})
        mgr.ram.wait()
        monkeypatch.undo()
        free = tiers.shutil.disk_usage(shm)
        monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: free._replace(free=4096))
        mgr.ram.make_room()
        monkeypatch.undo()
        ram = Path(tiers.ram_dir(str(root), str(shm)))
        assert _steps(ram) == [3] and _steps(root) == [2]
        with pytest.raises(tg.CheckpointError, match="disk full"):
            mgr.close(keep_ram_tier=True)
        got = torch.zeros(1)
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(shm), handle_signals=False) as again:
            assert again.restore({"t": got}) == 3 and got.item() == 33.0


@pytest.mark.parametrize("async_save", [False, True])
def test_an_old_ram_copy_that_cannot_be_removed_does_not_keep_the_new_step_off_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Step 2 commits in the RAM tier, and removing step 1's RAM copy fails (EACCES): step 2 must
    still be copied to the run directory (step 1's copy stays, with the event ``ram_remove_failed``).
    Before, the error left ``RamTier.committed`` before the copy started: a sync save raised a bare
    PermissionError through ``on_error="warn"``, an async one logged it and its second call did
    nothing; step 2 was in RAM only, and the clean ``close()`` removed the RAM tier with it."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.ones(1)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), ram_tier=str(shm),
                               async_save=async_save, on_error="warn", handle_signals=False).open()
    mgr.save(1, {"t": t})
    mgr.wait()
    _refuse_removing(monkeypatch, mgr, "step-000000001")
    t.fill_(2)
    mgr.save(2, {"t": t})
    mgr.wait()
    monkeypatch.undo()
    mgr.close()
    assert _steps(root) == [1, 2] and not os.path.exists(mgr.ram.dir)
    got = torch.zeros(1)
    tg.load(str(root / "step-000000002"), {"t": got})
    assert got.item() == 2.0
    events = (root / "events.jsonl").read_text()
    assert '"ram_remove_failed"' in events and '"ram_persist"' in events


class _Clock:
    """``trainguard.api``'s ``time`` with a wall clock the test sets (the manifests' ``created``)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_an_async_save_again_after_a_rollback_shows_retention_its_own_created_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async saves through the RAM tier, a rollback to step 5, step 6 saved again: the retention
    after its copy to disk must tell the policy the new step 6's ``created``, its manifest's.
    Before, the RAM tier's commit callback did not record it (the one without a RAM tier does),
    and the retention, which runs before the manager collects the save, gave the abandoned step 6's."""
    from trainguard import api
    from trainguard.retention import read_facts
    from trainguard.storage import LocalStorage

    seen: dict[int, float] = {}

    class Spy(tg.RetentionPolicy):
        def select(self, checkpoints):  # type: ignore[no-untyped-def]
            seen.update({c.step: c.created for c in checkpoints})
            return {c.step for c in checkpoints}

    clock = _Clock()
    monkeypatch.setattr(api, "time", clock)
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=Spy(), ram_tier=str(shm), async_save=True) as mgr:
            for s in range(1, 7):
                mgr.save(s, {"t": t})
            mgr.wait()
            mgr.ram.wait()
            assert seen[6] == 1_700_000_000.0
            assert mgr.restore({"t": t}, step=5) == 5
            clock.now = 1_800_000_000.0
            mgr.save(6, {"t": t}).result()
            mgr.ram.wait()  # the copy to disk and its retention, before the manager collects the save
            assert read_facts(LocalStorage(), str(root / "step-000000006"))[0] == 1_800_000_000.0
            assert seen[6] == 1_800_000_000.0


def test_a_stale_ram_copy_that_cannot_be_removed_does_not_fail_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 reached the run directory through the RAM tier and was deleted from it since: the RAM
    copy is stale, and removing it fails (EACCES). ``restore`` must leave it out and resume from
    step 1 of the run directory. Before, the bare PermissionError of the removal failed the
    ``restore`` (on rank 0 alone: the other ranks waited for its list of candidates)."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    t = torch.zeros(1)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(shm), handle_signals=False) as mgr:
        for s in (1, 2):
            t.fill_(s)
            mgr.save(s, {"t": t})
        mgr.close(keep_ram_tier=True)
    for f in (root / "step-000000002").iterdir():
        f.unlink()
    (root / "step-000000002").rmdir()
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(shm), handle_signals=False).open()
    _refuse_removing(monkeypatch, mgr, "step-000000002")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.restore({"t": t}) == 1 and t.item() == 1.0
    monkeypatch.undo()
    assert '"ram_remove_failed"' in (root / "events.jsonl").read_text()
    mgr.close()
