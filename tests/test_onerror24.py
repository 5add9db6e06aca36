"""``on_error="warn"`` and errors no retry fixes (session 24).

"warn" lets training go on after a failed save because the next save may succeed (a full disk
freed, a rank back). The run directory's lock lost (``runlock.lock_lost``: removed, replaced, or
taken by another job) fails every later save the same way. Warned, the job trained on for days
with no checkpoint while another writer could delete its files. It is raised on every rank now,
also when the background save of an async manager met it. A bad metric value, permanent for the
exit code, still warns (the next call passes new values: tests/test_newcode19_review.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_lock22_review import _another_job, _end, _Held, _state, _steps
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


def _other_manager_opens_and_closes(run: Path) -> None:
    """Another job (a real process) opens the run directory as a writer and closes it again."""
    code = "import sys, trainguard as tg\nwith tg.CheckpointManager(sys.argv[1], handle_signals=False): pass\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(run)], check=True, timeout=120, env=env)


@pytest.mark.parametrize("other", ["ended", "died"])
def test_lock_held_by_another_job_meanwhile_is_caught(tmp_path: Path, other: str) -> None:
    """The training process released its own lock (a copytree of the run directory closes a
    descriptor of .lock), another job took it, and let it go again before the next save: it ended
    (its close emptied the holder record) or died (its record stays). Before, that save took the
    lock again and committed: nothing noticed that another writer had the directory meanwhile."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run), handle_signals=False, on_error="warn") as mgr:
        mgr.save(1, _state(1.0), force=True)
        shutil.copytree(run, tmp_path / "backup")  # opens and closes run/.lock in this process
        if other == "ended":
            _other_manager_opens_and_closes(run)
            match = r"was held by another job meanwhile \(it ended and released it\)"
        else:
            said, pid, w = _another_job(run / ".lock")
            _end(pid, w)  # its process exits: its lock goes, its record stays
            assert said == "took"
            match = rf"was held by another job meanwhile \(pid {pid} on other"
        with pytest.raises(tg.CheckpointError, match=match) as e:
            mgr.save(2, _state(2.0), force=True)
        assert is_permanent(e.value)
    assert _steps(run) == ["step-000000001"]
