"""The RAM tier's open and clean close when a removal is refused (EACCES): open fails on every rank
with a ``CheckpointError`` that says what to do (before: a bare PermissionError on rank 0 while the
other ranks went on), and a clean ``close()`` warns and keeps the directory (before: a bare
PermissionError out of ``close()`` of a job whose checkpoints were all on disk)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.storage import LocalStorage

_REMOVE_TREE = LocalStorage.remove_tree


def _refused(self: LocalStorage, path: str) -> None:
    raise PermissionError(13, "Permission denied", path)


def _stale_ram_copy(root: str, base: str) -> None:
    """A RAM copy of step 3 of run directory ``root``, which is then deleted (the user starts over)."""
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        mgr.save(3, {"model": torch.nn.Linear(2, 2)})
        mgr.close(keep_ram_tier=True)
    shutil.rmtree(root)


def _open(rank: int, world: int, root: str, base: str) -> list[str]:
    if rank == 0:
        LocalStorage.remove_tree = _refused  # rank 0 cleans the RAM tier at open
    try:
        mgr = tg.CheckpointManager(root, ram_tier=base, handle_signals=False, timeout=30)
        mgr.open()
    except Exception as e:
        return [type(e).__name__, str(e)]
    finally:
        LocalStorage.remove_tree = _REMOVE_TREE
    mgr.close()
    return ["opened", ""]


def test_a_stale_ram_copy_that_cannot_be_removed_fails_open_on_every_rank_saying_what_to_do(tmp_path: Path) -> None:
    from dist_helper import run_ranks

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _stale_ram_copy(root, base)
    res = [r.value for r in run_ranks(_open, 2, root, base, timeout=90)]
    for name, msg in res:
        assert name == "CheckpointError", res
        assert "RAM tier: rank 0 could not prepare" in msg and "Permission denied" in msg and "ram_tier=" in msg
    # Nothing was lost: the stale copy is still there for the user to look at, the run directory is empty.
    assert [p.name for p in Path(base).rglob("step-*")] == ["step-000000003"]


def test_a_clean_close_whose_ram_tier_cannot_be_removed_warns_and_keeps_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trainguard.events import EVENTS_FILE

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    events = Path(root) / EVENTS_FILE
    os.makedirs(base)
    model = torch.nn.Linear(2, 2)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False).open()
    mgr.save(2, {"model": model})
    ram = mgr.ram.dir
    monkeypatch.setattr(LocalStorage, "remove_tree", _refused)
    mgr.close()  # before: PermissionError
    monkeypatch.undo()
    assert os.path.isdir(ram) and "could not remove the RAM tier" in caplog.text and ram in caplog.text
    failed = [json.loads(x) for x in events.read_text().splitlines() if '"ram_remove_failed"' in x]
    assert failed and "Permission denied" in failed[0]["error"]
    fresh = torch.nn.Linear(2, 2)
    assert not torch.equal(fresh.weight, model.weight)
    tg.load(os.path.join(root, "step-000000002"), {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)
