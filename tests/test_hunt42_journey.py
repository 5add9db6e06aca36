"""Session 42's adoption hunt ("journey"): a new user's training scripts, written from the docs,
run one process, 2 gloo ranks under torchrun / ``trainguard run``, and an elastic 2 -> 1 resume."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLAME = r'''
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: None)  # as a CheckpointManager does: save at the next step
rank = int(os.environ["RANK"])
time.sleep(1.0)
if rank == 1:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("a bug on rank 1")
time.sleep(20)
'''


@pytest.mark.parametrize("how, cause", [("kill", "killed by SIGKILL"), ("raise", "exit code 1")])
def test_failure_event_names_the_failed_rank_not_the_peer_the_agent_stopped(tmp_path, how, cause):
    """Script workers: rank 1 SIGKILLed (or raising), rank 0 handles SIGTERM (a manager's preemption save), so the
    agent's close SIGKILLed it 1 s later. Both then read "killed by SIGKILL" and the ``failure`` event
    (and ``trainguard report``) named rank 0, the lowest, while torch's own summary named rank 1; after
    rank 1's exception, rank 0's SIGKILL (not an exit 1) was taken as the cause the same way."""
    from trainguard.events import read_events

    script = tmp_path / "blame.py"
    script.write_text(BLAME)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           "--max-restarts", "0", "--run-dir", str(run_dir), str(script), how]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    failures = [e for e in read_events(run_dir) if e["event"] == "failure"]
    assert len(failures) == 1, failures
    assert failures[0]["failures"]["1"] == cause, failures
    assert failures[0]["rank"] == 1, failures  # before: 0, the peer the agent SIGKILLed after its SIGTERM


def test_a_drill_that_fired_before_the_job_shrank_is_not_warned_about(tmp_path, monkeypatch):
    """docs/elastic.md's 2 -> 1 drill (`--fault step=12,rank=1,kind=agent`): once rank 1's agent was
    gone, the survivor's first heartbeat at world size 1 warned that the drill "does not fire while this
    job has 1 rank(s) ...; name one of them with rank=", though it had fired. A drill not fired yet
    still is warned about (it fires if the job grows to it)."""
    import warnings

    from trainguard.elastic import faults, watchdog

    monkeypatch.setenv("TRAINGUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TRAINGUARD_FAULT", "step=12,rank=1,kind=agent;step=30,rank=1,kind=kill")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TRAINGUARD_WATCHDOG", raising=False)
    fired, pending = faults.faults_from_env()
    assert faults.claim(fired)  # rank 1 fired it at world size 2: the marker it leaves
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watchdog._Heart()
    said = [str(w.message) for w in caught if "fault drill" in str(w.message)]
    assert said == [f"fault drill {pending.spec()!r} does not fire while this job has 1 rank(s) (0..0); "
                    "name one of them with rank="], said


def test_stale_lock_warning_names_the_users_line_not_the_librarys(tmp_path):
    """A run resumed after a SIGKILL warned ``.../trainguard/onethread.py:57: UserWarning: taking over a
    stale lock ...`` (a fixed stacklevel counted without the manager's one-thread guard): the warning
    now names the script's ``with tg.CheckpointManager(...)`` line, as warnings of a library should."""
    import json
    import socket
    import warnings

    import trainguard as tg

    root = tmp_path / "run"
    root.mkdir()
    (root / ".lock").write_text(json.dumps({"pid": 4_194_000, "host": socket.gethostname(), "since": 0}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(str(root), handle_signals=False):  # the line the warning must name
            pass
    stale = [w for w in caught if "taking over a stale lock" in str(w.message)]
    assert len(stale) == 1, [str(w.message) for w in caught]
    assert (stale[0].filename, stale[0].lineno) == (__file__, _line_of("with tg.CheckpointManager(str(root)")), (
        stale[0].filename, stale[0].lineno)


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


THREADS = r'''
import os, torch
print("RANK", os.environ["RANK"], "threads", torch.get_num_threads(), "OMP", os.environ.get("OMP_NUM_THREADS"), flush=True)
'''


def test_a_forked_run_path_worker_runs_the_threads_omp_num_threads_asks_for(tmp_path):
    """``trainguard run --start-method fork --run-path`` (the demo's launch): torchrun sets
    OMP_NUM_THREADS=1 for its 2 workers, and script or spawned workers run 1 torch thread, but forked
    ones kept the agent's thread count (2 here): a run's losses differed from step 3 on from the same
    job launched with script workers, and the ranks oversubscribed the cores. (On a one-core machine the
    agent has 1 thread too, and this passes either way.)"""
    import os

    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           "--start-method", "fork", "--run-path", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
           str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = sorted(line for line in p.stdout.splitlines() if line.startswith("RANK"))
    assert lines == ["RANK 0 threads 1 OMP 1", "RANK 1 threads 1 OMP 1"], p.stdout
