"""Session 46's "old runs, new code" hunt: a run directory written by an older trainguard, resumed
by this one (an upgrade in the middle of a run)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

import trainguard as tg
from trainguard.tiers import RUN_ID, ram_copies, ram_dir


def _model(fill: float) -> torch.nn.Module:
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


def _old_ram_tier(tmp_path: Path, run_id: str | None) -> tuple[str, str, str]:
    """The run directory and RAM tier that trainguard before b0beff4 (2026-12-04) left for a run reached
    through a link (``link -> real``) that crashed after saving step 4 into RAM, before its copy to
    disk: step 2 on disk, step 4 only in RAM under the RAM directory named by the link's path (the
    sha1 of ``os.path.abspath(root)``, as in 485ec94's ``tiers.ram_dir``; 57eb3d9 wrote no run id).
    Checked against real runs of 485ec94 and 57eb3d9 (the report of session 46's hunt "upgrade")."""
    real, link, base = tmp_path / "real", tmp_path / "link", tmp_path / "shm"
    real.mkdir(parents=True)
    base.mkdir()
    link.symlink_to(real)
    tg.save(str(real / "step-000000002"), {"model": _model(2.0)})
    old = base / f"trainguard-ram-{os.getuid()}" / hashlib.sha1(os.fsencode(os.path.abspath(link))).hexdigest()[:16]
    old.mkdir(parents=True)
    tg.save(str(old / "step-000000004"), {"model": _model(4.0)})
    if run_id is not None:
        (real / RUN_ID).write_text(run_id)
        (old / RUN_ID).write_text(run_id)
    return str(link), str(base), str(old)


def test_a_ram_tier_an_older_version_named_by_the_links_path_is_resumed_from_and_not_left_behind(tmp_path: Path) -> None:
    for run_id in ("0123456789abcdef0123456789abcdef", None):  # 485ec94 wrote an id, 57eb3d9 none
        root, base, old = _old_ram_tier(tmp_path / (run_id or "noid"), run_id)
        assert ram_dir(root, base) != old  # the new name: the run directory's real path
        if run_id is not None:  # `trainguard ls` lists the copies the next open resumes from (before: none)
            assert ram_copies(root, base) == old
        model = _model(0.0)
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
            assert mgr.restore({"model": model}) == 4  # before: 2, the steps saved in RAM only were lost
            assert torch.equal(model.weight, torch.full((2, 3), 4.0))
            events = (Path(root) / "events.jsonl").read_text()
            assert '"ram_adopted"' in events and old in events
        assert not os.path.exists(old)  # before: left in /dev/shm, holding memory, until removed by hand
        assert (Path(root) / "step-000000004" / "manifest.json").exists()  # copied to disk from RAM
        model = _model(0.0)
        tg.load(os.path.join(root, "step-000000004"), {"model": model})
        assert torch.equal(model.bias, torch.full((2,), 4.0))


def test_an_older_ram_tier_of_another_run_under_the_links_path_is_neither_used_nor_removed(tmp_path: Path) -> None:
    root, base, old = _old_ram_tier(tmp_path, "0123456789abcdef0123456789abcdef")
    Path(old, RUN_ID).write_text("fedcba9876543210fedcba9876543210")  # the link led to another run then
    model = _model(0.0)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) == 2
        assert torch.equal(model.weight, torch.full((2, 3), 2.0))
    assert os.path.exists(os.path.join(old, "step-000000004", "manifest.json"))


def test_a_restore_without_ram_tier_says_that_the_ram_tier_holds_newer_steps(tmp_path: Path, caplog) -> None:
    """A run saved with ``ram_tier=True`` (/dev/shm) crashed after step 4 reached RAM only; the
    restart (an upgrade, a changed launch script) opens the manager without ``ram_tier``."""
    import shutil

    root = str(tmp_path / "run")
    tg.save(os.path.join(root, "step-000000002"), {"model": _model(2.0)})
    here = ram_dir(root)
    try:
        tg.save(os.path.join(here, "step-000000004"), {"model": _model(4.0)})
        for d in (root, here):
            Path(d, RUN_ID).write_text("0123456789abcdef0123456789abcdef")
        model = _model(0.0)
        with tg.CheckpointManager(root, handle_signals=False) as mgr, caplog.at_level("WARNING", "trainguard"):
            assert mgr.restore({"model": model}) == 2
        assert '"ram_unused"' in Path(root, "events.jsonl").read_text()  # before: no word
        assert any("holds steps [4]" in r.message and "ram_tier=True" in r.message for r in caplog.records)
        assert os.path.exists(os.path.join(here, "step-000000004", "manifest.json"))  # kept for that restart
        with tg.CheckpointManager(root, ram_tier=True, handle_signals=False) as mgr:
            assert mgr.restore({"model": model}) == 4
        assert torch.equal(model.weight, torch.full((2, 3), 4.0))
    finally:
        shutil.rmtree(here, ignore_errors=True)


def test_a_ram_copy_written_before_run_ids_is_not_restored_into_a_run_directory_started_over(tmp_path: Path) -> None:
    """trainguard before 2026-12-01 (57eb3d9) wrote no run id: its RAM copy of step 4 stays in the RAM tier
    after a crash, and the user removes the run directory to start over, with the new version."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    tg.save(os.path.join(ram_dir(root, base), "step-000000004"), {"model": _model(4.0)})  # no RUN_ID anywhere
    model = _model(0.0)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) is None  # before: 4, the deleted run's state
        assert torch.equal(model.weight, torch.zeros(2, 3))
        assert mgr.save(1, {"model": model}) is not None
    assert '"ram_discard"' in Path(root, "events.jsonl").read_text()
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-000000001"]
