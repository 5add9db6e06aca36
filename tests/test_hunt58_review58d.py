"""Session 58, review58d: several programs on one run directory, and checkpoints from elsewhere.

- a step directory copied in from another run was restored without a word (the manifest had no run
  identity): restore now names the run that wrote it (warning, ``foreign_run`` in the ``restore`` event);
- a second job refused by the lock was told pid, host and time, not which job: the holder record now
  carries the holder's command line (and Slurm job id);
- a requeued job whose old incarnation was still writing its last save after its stop signal failed for
  good (permanent ``LockedError``, advice to stop that job, which loses the save): it now waits for a
  holder that marked itself stopping, bounded by half the manager's timeout.

One holder subprocess (a real ``RunLock``: POSIX locks do not conflict within one process) serves the
lock tests; it is driven by lines on its stdin and answers on its stdout, every wait bounded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import trainguard as tg

SRC = str(Path(tg.__file__).resolve().parents[1])
HOLDER = r"""
import sys
from trainguard import runlock
lock = runlock.RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        runlock.mark_stopping(lock, 15)
        print("marked", flush=True)
    elif line.strip() == "release":
        lock.release()
        print("released", flush=True)
        break
"""


def _line(p: subprocess.Popen, want: str, timeout: float = 60) -> None:
    """Read the holder's next line (bounded by a timer that kills it): it must be ``want``."""
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        got = p.stdout.readline().strip()
    finally:
        timer.cancel()
    assert got == want, (got, p.stderr.read() if p.poll() is not None else "")


def test_restore_names_a_step_another_run_wrote(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ``cp -r exp-a/step-5 exp-b/`` and exp-b's restore loaded step 5 silently."""
    a, b, st = tmp_path / "exp-a", tmp_path / "exp-b", {"w": torch.ones(8)}
    with tg.CheckpointManager(a, save=tg.EveryNSteps(1), handle_signals=False) as m:
        m.save(5, st)
    with tg.CheckpointManager(b, save=tg.EveryNSteps(1), handle_signals=False) as m:
        m.save(3, st)
    shutil.copytree(a / "step-000000005", b / "step-000000005")
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(b, save=tg.EveryNSteps(1), handle_signals=False) as m:
            assert m.restore(st) == 5  # fine-tuning from a copy is legitimate: it loads
    assert "another run wrote" in caplog.text and str(a) in caplog.text, caplog.text
    ev = [json.loads(x) for x in (b / "events.jsonl").read_text().splitlines()]
    assert [e.get("foreign_run") for e in ev if e["event"] == "restore"] == [str(a)]
    # The run's own steps, a whole run directory copied (its id goes along), and a checkpoint without an
    # id (tg.save's, or one saved before ids) are restored without a word.
    caplog.clear()
    shutil.copytree(a, tmp_path / "exp-a2")
    shutil.rmtree(b / "step-000000005")
    tg.save(b / "step-000000004", st)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        for run, step in ((a, 5), (tmp_path / "exp-a2", 5), (b, 4)):
            with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as m:
                assert m.restore(st) == step
    assert "another run" not in caplog.text, caplog.text


def test_second_job_is_told_which_job_holds_the_lock_and_waits_for_one_stopping(tmp_path: Path) -> None:
    """Before: the refusal named pid/host/time only, and a holder finishing its last save after SIGTERM
    (an old incarnation of a requeued job) made the new one fail for good (permanent, exit 78)."""
    root = tmp_path / "run"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), "--copied-launch-script"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _line(p, "held")
        with pytest.raises(tg.LockedError) as e:  # still training: refused at once, naming its command line
            tg.CheckpointManager(root, handle_signals=False, timeout=60).open()
        assert f"pid {p.pid} " in str(e.value) and "--copied-launch-script" in str(e.value), str(e.value)
        p.stdin.write("stop\n")
        p.stdin.flush()
        _line(p, "marked")

        class Release(logging.Handler):  # the new job says it waits: then (and only then) the old one ends
            def emit(self, record: logging.LogRecord) -> None:
                if "waiting up to" in record.getMessage() and p.poll() is None:
                    p.stdin.write("release\n")
                    p.stdin.flush()

        h = Release()
        logging.getLogger("trainguard").addHandler(h)
        try:
            with tg.CheckpointManager(root, handle_signals=False, timeout=60) as m:
                assert m.restore({"w": torch.ones(2)}) is None
        finally:
            logging.getLogger("trainguard").removeHandler(h)
        _line(p, "released")
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_the_lock_record_hides_the_values_of_options_named_like_secrets(monkeypatch):
    from trainguard import stopwait

    monkeypatch.setattr(stopwait.sys, "argv", ["train.py", "--config", "a.yaml", "--hf-token", "hf_abc", "--api-key=sk1", "PASSWORD=pw", "--lr", "3e-4"])
    cmd = stopwait.who()["cmd"]
    assert "a.yaml" in cmd and "3e-4" in cmd  # what tells two copy-pasted jobs apart stays
    assert "hf_abc" not in cmd and "sk1" not in cmd and "pw" not in cmd.replace("PASSWORD", "")
    assert "--hf-token ***" in cmd and "--api-key=***" in cmd and "PASSWORD=***" in cmd
