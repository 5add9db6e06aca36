"""Session 21 review (area "lock"): the run directory's writer lock while a job runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import trainguard as tg


def _state(v: float) -> dict:
    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.fill_(v)
    return {"m": m}


def test_run_directory_removed_under_a_live_manager_fails_the_next_save(tmp_path):
    """`rm -rf run` while the job ran: the next save recreated the directory and committed
    step 2 there without a .lock (the job's lock named the deleted file), and a second job then
    opened the same directory as a writer. Now the save fails, saying so, and writes nothing."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run)) as mgr:
        mgr.save(1, _state(1.0), force=True)
        shutil.rmtree(run)
        with pytest.raises(tg.CheckpointError, match=r"\.lock was removed .*another job could open it as a writer"):
            mgr.save(2, _state(2.0), force=True)
        assert not (run / "step-000000002").exists()


def test_lock_file_replaced_under_a_live_manager_fails_the_save_and_keeps_the_checkpoint(tmp_path):
    """Only `.lock` removed, then a second job (another process) opened the directory: it took a
    new lock file, both were writers. The first job's next save now fails; step 1 is intact."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run)) as mgr:
        mgr.save(1, _state(1.0), force=True)
        os.remove(run / ".lock")
        code = "import sys, trainguard as tg; tg.CheckpointManager(sys.argv[1]).open(); print('opened')"
        other = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "opened", other.stderr[-2000:]  # the danger: a second writer
        with pytest.raises(tg.CheckpointError, match=r"\.lock was replaced by another file"):
            mgr.save(2, _state(2.0), force=True)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000000001"]
    state = _state(0.0)
    with pytest.warns(UserWarning, match="stale lock"), tg.CheckpointManager(str(run)) as mgr:  # the second job's, exited
        assert mgr.restore(state) == 1
    assert torch.equal(state["m"].weight, torch.ones(2, 2))


def _removed_ranks(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    with tg.CheckpointManager(root, on_error="raise", timeout=30) as mgr:
        mgr.save(1, _state(1.0), force=True)
        torch.distributed.barrier()  # every rank is done with step 1 (rank 1 may still be leaving its last round)
        if rank == 0:
            shutil.rmtree(root)
        torch.distributed.barrier()
        try:
            mgr.save(2, _state(2.0), force=True)
            out["saved"] = True
        except tg.CheckpointError as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["step2"] = os.path.exists(os.path.join(root, "step-000000002"))
    return out


def test_run_directory_removed_fails_the_save_on_every_rank(tmp_path):
    """Two gloo ranks: rank 0 (the lock's holder) finds the lock gone; its error reaches rank 1
    through the save's first round, so both raise at once and nothing is committed."""
    from dist_helper import run_ranks

    res = run_ranks(_removed_ranks, 2, str(tmp_path / "run"), timeout=60)
    assert all(r.error is None and r.exitcode == 0 for r in res), [r.error for r in res]
    for r in res:
        assert "saved" not in r.value, (r.rank, r.value)
        assert ".lock was removed" in r.value["error"], (r.rank, r.value["error"])
        assert r.value["step2"] is False


def test_lock_copied_from_a_live_run_is_not_called_stale(tmp_path):
    """`cp -r` of a live run directory copies its .lock; a job opening the copy warned "taking over
    a stale lock ... left by pid X" while pid X (this test process) was alive, writing the original.
    Now the warning says the holder is alive and the lock file is a copy."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run)) as mgr:
        mgr.save(1, _state(1.0), force=True)
        shutil.copytree(run, tmp_path / "copy")
        code = ("import sys, warnings, trainguard as tg\nwith warnings.catch_warnings(record=True) as w:\n"
                "    warnings.simplefilter('always'); tg.CheckpointManager(sys.argv[1]).open()\n"
                "print('|'.join(str(x.message) for x in w))")
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "copy")], capture_output=True, text=True, timeout=60)
    msg = other.stdout.strip()
    assert f"pid {os.getpid()} " in msg, (msg, other.stderr[-2000:])
    assert "stale" not in msg and "alive but does not hold this file" in msg and "cp -r" in msg, msg


@pytest.mark.parametrize("make", [
    lambda: tg.KeepLatest(1), lambda: tg.KeepEvery(0), lambda: tg.KeepBest("loss", n=0), lambda: tg.KeepBest("loss", mode="avg"),
    lambda: tg.EveryNSteps(0), lambda: tg.EverySeconds(-1), lambda: tg.EverySeconds("x"),
])
def test_refused_policy_still_has_a_repr_in_a_traceback_with_locals(make):
    """A refused KeepLatest(1): the half-built object in __init__'s frame had no ``n``, so its repr
    raised AttributeError, and a traceback with locals (traceback's capture_locals, as unittest
    --locals, rich or a crash reporter use) raised that instead of showing the ValueError."""
    import traceback

    with pytest.raises(ValueError) as info:
        make()
    text = "".join(traceback.TracebackException.from_exception(info.value, capture_locals=True).format())
    assert str(info.value) in text
    shown = [line.strip() for line in text.splitlines() if line.strip().startswith("self = ")]
    name = str(info.value).split("(")[0]  # the refusal names the policy: "KeepLatest(1): keep at least 2 ..."
    assert shown and shown[-1].startswith(f"self = {name}("), shown
