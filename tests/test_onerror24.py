"""``on_error="warn"`` and errors no retry fixes (session 24).

"warn" lets training go on after a failed save because the next save may succeed (a full disk
freed, a rank back). The run directory's lock lost (``runlock.lock_lost``: removed, replaced, or
taken by another job) fails every later save the same way. Warned, the job trained on for days
with no checkpoint while another writer could delete its files. It is raised on every rank now,
also when the background save of an async manager met it. A bad metric value, permanent for the
exit code, still warns (the next call passes new values: tests/test_newcode19_review.py)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_lock22_review import _Held, _state, _steps
from trainguard.permanent import is_permanent

from dist_helper import run_ranks


def test_lock_removed_is_raised_with_on_error_warn(tmp_path: Path) -> None:
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), on_error="warn")
    mgr.open()
    try:
        mgr.save(1, _state(1.0))
        os.remove(tmp_path / ".lock")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not a warning: an error
            with pytest.raises(tg.CheckpointError, match="was removed while this job held it") as got:
                mgr.save(2, _state(2.0))
        assert is_permanent(got.value)
        assert _steps(tmp_path) == ["step-000000001"]
    finally:
        mgr._lock.release()  # the descriptor of the removed file
        mgr._lock = None
        mgr.close()


def test_transient_failure_still_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), on_error="warn") as mgr:
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_fsync")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        with pytest.warns(UserWarning, match="save of step 1 failed"):
            assert mgr.save(1, _state(1.0)) is None
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        assert mgr.save(2, _state(2.0)) is not None
    assert _steps(tmp_path) == ["step-000000002"]


def test_async_commit_after_lock_removed_is_raised_at_wait(tmp_path: Path) -> None:
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), on_error="warn", async_save=True)
    mgr.open()
    held = _Held("commit_dir")
    try:
        mgr.save(1, _state(1.0))
        held.reached()  # the background save is at its commit; the lock goes meanwhile
        os.remove(tmp_path / ".lock")
        held.go()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(tg.CheckpointError, match="was removed while this job held it") as got:
                mgr.wait()
        assert is_permanent(got.value)
        assert _steps(tmp_path) == []  # not committed into the unlocked directory
    finally:
        held.go()
        mgr._lock.release()
        mgr._lock = None
        mgr.close()


def _two_ranks(rank: int, world: int, root: str) -> str:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), on_error="warn")
        mgr.open()
        mgr.save(1, _state(1.0))
        if rank == 0:
            os.remove(os.path.join(root, ".lock"))
        try:
            mgr.save(2, _state(2.0))
        except tg.CheckpointError as e:
            assert is_permanent(e), e
            return str(e)
        finally:
            if mgr._lock:
                mgr._lock.release()
                mgr._lock = None
            mgr.close()
    return "saved"


def test_every_rank_raises_the_lost_lock(tmp_path: Path) -> None:
    out = [r.value for r in run_ranks(_two_ranks, 2, str(tmp_path), timeout=90)]
    assert all("was removed while this job held it" in v for v in out), out
    assert _steps(tmp_path) == ["step-000000001"]
