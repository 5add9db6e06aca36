"""Session 58, review58g: a hostile review of review58d (run ids in manifests, the lock record's command
line, waiting for a stopping holder).

- a holder that marked itself stopping (a stop signal seen by ``save``) and then went on training (a loop
  not checking ``mgr.should_stop``, a notebook interrupted and resumed) made every new job wait half its
  timeout (300 s by default) and then fail with a non-permanent error: under ``trainguard run`` each restart
  waited 300 s again, where before review58d the job exited 78 at once. A mark older than the manager's
  timeout is no longer waited for, and the refusal is permanent again for a live holder of this host.

One holder subprocess (a real ``RunLock``: POSIX locks do not conflict within one process), driven by
lines on its stdin, every wait bounded.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainguard as tg
from test_hunt58_review58d import _line  # the holder subprocess's next line, bounded
from trainguard.permanent import is_permanent

SRC = str(Path(tg.__file__).resolve().parents[1])
HOLDER = r"""
import json, os, sys, time
from trainguard import runlock
lock = runlock.RunLock(sys.argv[1])
lock.acquire()
runlock.mark_stopping(lock, 15)
rec = json.loads(lock._info)
rec["stopping"] = time.time() - 3600  # got its stop signal an hour ago, and still runs
os.ftruncate(lock.fd, 0)
os.pwrite(lock.fd, json.dumps(rec).encode(), 0)
print("held", flush=True)
sys.stdin.readline()
"""



def test_a_holder_stopping_for_longer_than_the_timeout_is_refused_at_once_for_good(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: waited timeout/2, then a non-permanent LockedError (trainguard run: restart, wait again)."""
    root = tmp_path / "run"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _line(p, "held")
        with caplog.at_level(logging.INFO, logger="trainguard"), pytest.raises(tg.LockedError) as e:
            tg.CheckpointManager(root, handle_signals=False, timeout=4).open()
        assert "waiting up to" not in caplog.text, caplog.text
        assert is_permanent(e.value), str(e.value)  # a live holder of this host: exit 78, no restart loop
        assert f"pid {p.pid} " in str(e.value) and "should_stop" in str(e.value), str(e.value)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_an_object_store_error_on_the_run_id_fails_neither_restore_nor_save(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the run id's read/write caught OSError only; botocore's EndpointConnectionError (no OSError: an
    endpoint unreachable for a moment) on the id file raised out of a restore that had loaded its step, and out
    of the first save past ``on_error``. The id is advisory: the save and the restore go on without it."""
    import torch
    from botocore.exceptions import EndpointConnectionError

    from trainguard.ramview import RUN_ID

    root, st = "memory://review58g/idfail", {"w": torch.ones(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as m:
        m.save(1, st)

    def flaky(m: tg.CheckpointManager) -> None:
        exists = m.storage.exists

        def patched(path: str) -> bool:
            if path.endswith(RUN_ID):
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
            return exists(path)

        m.storage.exists = patched  # type: ignore[method-assign]

    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as m:
            flaky(m)
            assert m.restore(st) == 1
        with tg.CheckpointManager(root + "2", save=tg.EveryNSteps(1), handle_signals=False) as m:
            flaky(m)
            assert m.save(1, st) is not None
    assert "cannot read or write the run id" in caplog.text, caplog.text
    with tg.CheckpointManager(root + "2", handle_signals=False) as m:  # that save committed
        assert m.restore(st) == 1


def test_a_manager_opened_again_after_its_directory_was_removed_names_the_new_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the run id was read once per manager object; a notebook's ``with mgr:`` again after ``rm -rf run``
    (start over) saved with the deleted run's id, and the next job warned that its own step came from another run."""
    import shutil

    import torch

    root, st = tmp_path / "run", {"w": torch.ones(3)}
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False)
    with mgr:
        mgr.save(1, st)
    shutil.rmtree(root)
    with mgr:
        assert mgr.restore(st) is None
        assert mgr.save(2, st) is not None
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(root, handle_signals=False) as m:
            assert m.restore(st) == 2
    assert "another run" not in caplog.text, caplog.text


def test_the_lock_record_hides_url_credentials_and_secret_query_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the .lock record (0644, in the run directory) kept ``postgresql://u:pw@host``, a presigned URL's
    signature and ``--db-pass X`` as given: only options named token/key/secret/passw/auth/cred were hidden."""
    from trainguard import stopwait

    monkeypatch.setattr(stopwait.sys, "argv", [
        "train.py", "--db", "postgresql://u:pw123@h/db", "--data=https://h/x?X-Amz-Signature=SIG1&a=1",
        "--db-pass", "pw2", "https://ex.com/a?token=TT9&x=1", "--lr", "3e-4"])
    cmd = stopwait.who()["cmd"]
    for secret in ("pw123", "SIG1", "pw2", "TT9"):
        assert secret not in cmd, cmd
    assert "postgresql://" in cmd and "h/db" in cmd and "3e-4" in cmd and "a=1" in cmd, cmd  # the rest stays


def test_a_manager_opens_with_a_program_s_own_sys_argv_of_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the lock record's command line called str methods on each ``sys.argv`` item; a program that set
    ``sys.argv`` with a ``pathlib.Path`` in it (a launcher, a test harness) could not open a manager."""
    from trainguard import stopwait

    monkeypatch.setattr(stopwait.sys, "argv", ["train.py", tmp_path / "cfg.yaml"])
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False):
        pass
    assert (tmp_path / "run" / ".lock").exists()


def test_the_lock_record_names_a_slurm_array_task_as_squeue_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: task 3 of array job 1000 (its own SLURM_JOB_ID 1003) was named "slurm 1003_3", which no squeue
    line shows and scancel does not take; it is "slurm 1000_3 (job 1003)" now."""
    from trainguard import stopwait

    monkeypatch.setenv("SLURM_JOB_ID", "1003")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1000")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert stopwait.who()["job"].startswith("slurm 1000_3"), stopwait.who()
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert stopwait.who()["job"] == "slurm 1003"


TAKER = r"""
import sys
from trainguard import runlock
lock = runlock.RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_stop_signal_after_the_lock_was_lost_leaves_the_new_holder_s_record_alone(tmp_path: Path) -> None:
    """Before: ``mark_stopping`` wrote this process's record, marked stopping, over whatever the file held: after
    the lock was lost (a backup closing a descriptor of .lock) and taken by another job, that job's record then
    said "stopping", and a third job waited for it (timeout/2) though it was training."""
    import json

    from trainguard import runlock

    root = tmp_path / "run"
    root.mkdir()
    mine = runlock.RunLock(str(root))
    mine.acquire()
    os.close(os.open(root / ".lock", os.O_RDONLY))  # any close of the file drops this process's POSIX lock
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", TAKER, str(root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _line(p, "held")
        runlock.mark_stopping(mine, 15)
        rec = json.loads((root / ".lock").read_bytes())
        assert rec["pid"] == p.pid and "stopping" not in rec, rec
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)
        mine.release()
