"""A retention delete that never returns (a hung NFS server) after an async save committed: the
manager's next wait raised nothing and hung with the delete (session 41; found from the commit
review's open question). ``iostall.oldest`` only looked at calls on the save's own target, and the
retention the save thread runs once committed removes *other* steps' directories, unrecorded."""

from __future__ import annotations

import threading

import pytest
import torch

import trainguard as tg
from trainguard.storage import local


def test_a_retention_delete_stuck_after_the_commit_raises_stuck_write_error_not_a_hang(tmp_path, monkeypatch):
    gate, entered = threading.Event(), threading.Event()
    real = local.LocalStorage.remove_tree

    def remove_tree(self, path: str) -> None:
        if path.endswith("step-000000001"):  # retention's delete of the oldest step, on the save thread
            entered.set()
            gate.wait(20)  # bounded: before the fix the manager's wait returned only when this did
        real(self, path)

    monkeypatch.setattr(local.LocalStorage, "remove_tree", remove_tree)
    state = {"w": torch.arange(64.0)}
    mgr = tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                               timeout=1, handle_signals=False).open()
    try:
        for step in (1, 2, 3):
            mgr.save(step, state)
        with pytest.raises(tg.StuckWriteError, match=r"retention after step 3 .*The checkpoint of that step is committed"):
            mgr.wait()
        assert entered.is_set() and not gate.is_set()
        assert (tmp_path / "run" / "step-000000003" / "manifest.json").exists()
    finally:
        gate.set()
    mgr.close()  # the delete returned: the save in flight ends, the manager closes
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000000002", "step-000000003"]
    assert mgr.last_saved_step == 3
