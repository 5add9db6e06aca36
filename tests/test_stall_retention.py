"""The stall counts the retention deletes where the training thread runs them (rank 0): a sync
save's inside its own save() call, logged in its save_retention event (after its save event, which
is written at the commit: a kill during the deletes keeps it). An async save's run on its save thread once it commits
(retention.at_commit); before, they ran inside the call that collected it (the next save), whose
stall they were (0.13-0.34 s per 1 GB checkpoint here). A save() that has to wait for them counts
that as waiting for the previous save (``stall_prev_s``), not as its own stall. On a parallel
filesystem deleting an old checkpoint can take seconds, and DalyInterval and `trainguard report`
read this stall. The clock the manager reads is shifted by 5 s for each delete (no sleep, no
timing assert on the real clock)."""

from __future__ import annotations

import time
import types

import torch

import trainguard as tg
from trainguard import manager as manager_mod
from trainguard.events import read_events


def test_the_stall_counts_retention_deletes_where_the_training_thread_runs_them(tmp_path, monkeypatch):
    shift = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + shift[0], time=time.time)
    monkeypatch.setattr(manager_mod, "time", clock)
    state = {"model": torch.nn.Linear(8, 8)}
    for async_save in (False, True):
        root = tmp_path / ("async" if async_save else "sync")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=async_save) as mgr:
            real = mgr.storage.remove_tree

            def slow_delete(path, real=real):
                if "step-" in str(path) and ".tmp" not in str(path):
                    shift[0] += 5.0  # a 5 s delete on a slow filesystem
                return real(path)

            monkeypatch.setattr(mgr.storage, "remove_tree", slow_delete)
            for step in (1, 2, 3, 4):
                mgr.save(step, state)
            mgr.wait()
        events = [e for e in read_events(root) if e["event"] == "save"]
        saves = {e["step"]: e["stall_s"] for e in events}
        deletes = [e["step"] for e in read_events(root) if e["event"] == "retention_delete"]
        assert deletes == [1, 2]
        if async_save:  # on the save thread: at most waited for, as for the previous save
            assert all(e["stall_s"] - e["stall_prev_s"] < 5.0 for e in events), events
        else:  # inside the save() that committed the step: its save_retention event, after the save event
            after = {e["step"]: e["stall_s"] for e in read_events(root) if e["event"] == "save_retention"}
            assert after[3] >= 5.0 and after[4] >= 5.0 and max(after[1], after[2]) < 5.0
            assert max(saves.values()) < 5.0  # the save event is written at the commit, before the deletes
