"""Review of `trainguard run` (elastic agent, watchdog): regressions for what it found."""

from __future__ import annotations

import torch

import trainguard as tg
import trainguard.manager as manager_mod
from trainguard.elastic import watchdog
from trainguard.elastic.watchdog import Watchdog


def _heart(monkeypatch) -> Watchdog:
    class Heart:
        watchdog = Watchdog(timeout=1.0)  # not started: only its state is looked at

    monkeypatch.setattr(watchdog, "_HEART", Heart())
    return Heart.watchdog


def test_rollback_restore_and_wait_in_the_loop_are_not_timed_as_a_hang(tmp_path, monkeypatch):
    # A rollback (mgr.restore inside the loop, after the first heartbeat) that read a large checkpoint
    # for longer than the hang timeout was declared a hang: `trainguard run --hang-timeout 2` with a
    # restore taking 4 s ended both ranks with exit 75. restore() and wait() are now paused, as save() is.
    state = {"model": torch.nn.Linear(2, 2)}
    seen: list[tuple[str, bool]] = []
    wd = Watchdog(timeout=1.0)  # replaced by the process's watchdog below
    real_load, real_finish = manager_mod.load, manager_mod.CheckpointManager._finish_pending

    def load(*a, **k):
        seen.append(("load", wd._paused))
        return real_load(*a, **k)

    def finish(self):
        seen.append(("wait", wd._paused))
        return real_finish(self)

    monkeypatch.setattr(manager_mod, "load", load)
    monkeypatch.setattr(manager_mod.CheckpointManager, "_finish_pending", finish)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1)) as mgr:
        mgr.save(1, state)  # no _HEART yet: the watchdog arms at a heartbeat inside trainguard run
        wd = _heart(monkeypatch)
        wd.beat(2)
        seen.clear()
        mgr.wait()
        assert seen == [("wait", True)] and not wd._paused  # timed again after it: a real hang is still one
        seen.clear()
        assert mgr.restore(state) == 1
        assert ("load", True) in seen and all(p for _, p in seen), seen
        assert not wd._paused
    assert wd._paused  # close() suspends until the next heartbeat; its own wait() does not resume the watchdog
