"""Review of the object-store and RAM-tier paths: each test reproduces a bug found there."""

from __future__ import annotations

import os

import pytest
import torch

import trainguard as tg

from conftest import filled_linear as _model


def test_ram_tier_save_of_a_step_the_durable_root_holds_is_refused_not_silently_dropped(tmp_path):
    # An earlier run left step 1 on disk (its RAM copy removed by a clean close). A new run that
    # did not restore saves step 1 again: without the RAM tier a StepExistsError; with it, the save
    # went to RAM and the copy to disk found a manifest there and skipped it: the save "succeeded",
    # the disk kept the earlier run's step 1 and the clean close deleted the only copy of the new one.
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(1.0)})
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        with pytest.raises(tg.StepExistsError, match="did not restore"):
            mgr.save(1, {"model": _model(2.0)})
    dest = _model(0.0)
    tg.load(os.path.join(root, "step-000000001"), {"model": dest})
    assert torch.all(dest.weight == 1.0)


def test_a_data_object_deleted_while_a_restore_reads_it_falls_back_to_the_older_step(monkeypatch):
    # Retention (or an operator) deletes step 2 after restore checked its objects and before it
    # reads them: locally the missing file is a CorruptCheckpointError and restore falls back to
    # step 1; on an object store the filesystem's FileNotFoundError went through restore as is.
    import uuid

    from trainguard.storage.fsspec import FsspecStorage

    url = f"memory://review-{uuid.uuid4().hex[:8]}"
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(1.0)})
        mgr.save(2, {"model": _model(2.0)})
    orig = FsspecStorage.open_read

    def open_read(self, path):
        if "step-000000002" in path:
            self.fs.rm_file(path)  # the concurrent delete, right before the first ranged GET
        return orig(self, path)

    monkeypatch.setattr(FsspecStorage, "open_read", open_read)
    dest = _model(0.0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert mgr.restore({"model": dest}) == 1
    assert torch.all(dest.weight == 1.0)
