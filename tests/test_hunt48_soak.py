"""Soak findings (session 48): what grows with the number of saves, opens and restarts of a long run.

A CheckpointManager object entered again after ``close()`` (the same object in another ``with``
block: one per epoch, per evaluation phase) registered one more ``weakref.finalize`` for its run
lock at every ``open()``, each kept (with its registry entry) until the manager was collected:
300 opens, 300 finalizers. Now one per manager, which still releases the lock of a manager dropped
without ``close()`` after it was opened again.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import trainguard as tg


def _finalizers_of(owner: object) -> int:
    return sum(1 for f in list(weakref.finalize._registry) if f.peek() is not None and f.peek()[0] is owner)  # type: ignore[attr-defined]


def test_a_manager_opened_again_keeps_one_lock_finalizer(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    mgr = tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False)
    counts = {}
    for step in range(1, 31):
        with mgr:
            assert mgr.save(step, {"model": model}) is not None
        counts[step] = _finalizers_of(mgr)
    assert counts[5] == 1
    assert counts[30] == counts[5]  # before: one more per open (30 after 30 opens)
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as check:
        assert check.latest_step() == 30

    # The one finalizer still does its job: opened again, dropped without close(), the lock is released.
    mgr.open()
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        del mgr
        gc.collect()
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as again:  # not LockedError
        assert again.latest_step() == 30
