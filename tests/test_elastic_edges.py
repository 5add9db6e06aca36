"""trainguard run, edge cases: the orphan check under forkserver (the agent's pid, not the parent's),
lost steps scoped to the job, SIGTERM to the agent, and the watchdog's pause/resume around saves
and after ``CheckpointManager.close``.

Every process started here is bounded in time (a deadline in the child script, a timeout on each
wait) and killed by its pid at the end of its test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from trainguard.elastic import watchdog
from trainguard.elastic.watchdog import ORPHAN_EXIT, Watchdog, _lost_steps, _proc_stat, agent_alive
from trainguard.events import EventLog, read_events

CLI = [sys.executable, "-c", "from trainguard.cli import main; main()", "run"]


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``cond`` until true (bounded); fail early when ``proc`` (an agent) exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    out = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    pytest.fail(f"timed out waiting for {what}\n{out}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not reaped yet
    except psutil.NoSuchProcess:
        return True


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ---------------------------------------------------------------- orphan check (agent pid)


def test_agent_alive_sees_death_zombies_and_reused_pids():
    me = _proc_stat(os.getpid())
    assert me is not None and me[0] in ("R", "S")
    assert agent_alive(os.getpid(), me[1])
    assert not agent_alive(os.getpid(), me[1] + 1)  # the same pid, another process: a reused pid
    assert not Watchdog(agent_pid=os.getppid()).orphaned()  # armed on a live agent (this test's parent)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = _proc_stat(child.pid)[1]
        assert agent_alive(child.pid, start)
        assert Watchdog(agent_pid=child.pid).orphaned()  # started after this worker: a reused pid, not its agent
        child.kill()  # not reaped: a zombie, which os.kill(pid, 0) still finds
        _wait_for(lambda: (_proc_stat(child.pid) or ("Z",))[0] == "Z", 10, "the zombie")
        assert not agent_alive(child.pid, start)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert not agent_alive(child.pid, start)  # reaped: no such process


HEARTBEAT_LOOP = """\
    import os, sys, time
    from trainguard.elastic import heartbeat
    deadline = time.monotonic() + float(sys.argv[2])  # bounded even when the orphan check fails
    step = 0
    while time.monotonic() < deadline:
        step += 1
        heartbeat(step)
        if step == 1:
            with open(os.path.join(sys.argv[1], "armed-" + os.environ.get("RANK", "0")), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(0.05)
    print("deadline reached: the orphan check did not fire", flush=True)
"""


@pytest.mark.timeout(150)
def test_watchdog_exits_76_when_the_agent_pid_dies_while_its_parent_lives(tmp_path):
    # The worker's parent (this test) stays alive, as a forkserver does: only the agent pid tells.
    loop = _script(tmp_path, "loop.py", HEARTBEAT_LOOP)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for the agent
    env = {**os.environ, "TRAINGUARD_WATCHDOG": "1", "TRAINGUARD_AGENT_PID": str(agent.pid), "RANK": "0",
           "TRAINGUARD_RUN_DIR": str(tmp_path), "TRAINGUARD_HANG_TIMEOUT": "60"}
    env.pop("TRAINGUARD_FAULT", None)
    worker = subprocess.Popen([sys.executable, str(loop), str(tmp_path), "20"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # Its start (a Python that imports torch: 27-38 s measured at load 15 on 2 cores) comes first.
        _wait_for(lambda: (tmp_path / "armed-0").exists(), 100, "the worker's first heartbeat", worker)
        agent.kill()  # SIGKILL, and not reaped yet: a zombie for the watchdog to see through
        out = worker.communicate(timeout=20)[0].decode(errors="replace")
        assert worker.returncode == ORPHAN_EXIT, out
        assert f"agent (pid {agent.pid}) is gone" in out
        orphaned = [e for e in read_events(tmp_path) if e["event"] == "orphaned"]
        assert len(orphaned) == 1 and orphaned[0]["agent_pid"] == agent.pid
    finally:
        _kill_all([worker.pid, agent.pid])
        worker.wait(timeout=10)
        agent.wait(timeout=10)


@pytest.mark.timeout(150)
def test_forkserver_workers_exit_orphaned_when_the_agent_is_killed(tmp_path):
    # With --start-method forkserver a worker's parent is the forkserver, which outlives the agent
    # while any worker lives: workers compared getppid() and trained on forever.
    run_dir, log = tmp_path / "run", tmp_path / "agent.log"
    loop = _script(tmp_path, "loop.py", HEARTBEAT_LOOP)
    cmd = [*CLI, "--nproc-per-node", "2", "--start-method", "forkserver", "--run-path", "--run-dir", str(run_dir),
           "--hang-timeout", "60", str(loop), str(tmp_path), "60"]
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[int] = []
    try:
        armed = [tmp_path / "armed-0", tmp_path / "armed-1"]
        _wait_for(lambda: all(p.exists() and p.read_text() for p in armed), 100, "both workers' first heartbeat",
                  agent, log)
        workers = sorted(int(p.read_text()) for p in armed)
        tree = [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]  # forkserver, workers, ...
        assert set(workers) <= set(tree)
        assert all(psutil.Process(w).ppid() != agent.pid for w in workers)  # children of the forkserver
        agent.kill()
        agent.wait(timeout=10)
        _wait_for(lambda: all(_gone(p) for p in tree), 20, "the workers and the forkserver to exit", log=log)
        orphaned = [e for e in read_events(run_dir) if e["event"] == "orphaned"]
        assert sorted(e["pid"] for e in orphaned) == workers, orphaned
        assert {e["rank"] for e in orphaned} == {0, 1} and {e["agent_pid"] for e in orphaned} == {agent.pid}
        text = log.read_text(errors="replace")
        assert text.count(f"agent (pid {agent.pid}) is gone") == 2 and "deadline reached" not in text
    finally:
        _kill_all([*tree, agent.pid])
        agent.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)  # the session this test started for the agent


# ---------------------------------------------------------------- lost steps of this job only


def _log_job(log: EventLog, job: str, steps: range) -> None:
    """An agent_start of ``job`` (as ``launcher.main`` logs it), then rank 0's step events."""
    log.emit("agent_start", job_id=job)
    for s in steps:
        log.emit("step", step=s, world_size=1)


def test_lost_steps_count_only_this_jobs_steps(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    _log_job(log, "job-a", range(1, 7))  # an earlier job ran to step 6 in this run directory
    log.emit("agent_exit", ok=True)
    _log_job(log, "job-b", range(0))
    assert _lost_steps(path, 1, "job-b") == 0  # a fresh second job lost nothing (was 6)
    for s in range(1, 4):  # job b runs to step 3, fails and restarts from scratch
        log.emit("step", step=s, world_size=1)
    assert _lost_steps(path, 1, "job-b") == 3
    _log_job(log, "job-b", range(0))  # a second agent of the same job joins: its steps still count
    assert _lost_steps(path, 2, "job-b") == 2
    # Plain torchrun (no TRAINGUARD_JOB_ID, or no agent_start of it): the steps since the last agent_start.
    assert _lost_steps(path, 1, None) == 0
    assert _lost_steps(path, 1, "job-c") == 0
    log.emit("step", step=1, world_size=1)
    log.emit("step", step=2, world_size=1)
    assert _lost_steps(path, 1, None) == 2
    bare = tmp_path / "torchrun.jsonl"  # no agent_start at all: every step counts
    for st in range(1, 7):
        EventLog(bare).emit("step", step=st, world_size=1)
    assert _lost_steps(bare, 4, None) == 3 and _lost_steps(bare, 7, None) == 0


# ---------------------------------------------------------------- SIGTERM to the agent


@pytest.mark.timeout(150)
def test_sigterm_to_agent_saves_logs_agent_exit_and_exits_143(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "agent.log"
    train = _script(tmp_path, "train.py", """\
        import os, sys, time
        import torch
        import trainguard as tg
        model = torch.nn.Linear(4, 4)
        deadline = time.monotonic() + 60  # bounded even when no signal comes
        with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(1000)) as mgr:
            step = 0
            while not mgr.should_stop and time.monotonic() < deadline:
                step += 1
                time.sleep(0.02)
                mgr.save(step, {"model": model})
                if step == 1:
                    open(os.path.join(sys.argv[1], "armed"), "w").close()
        print(f"worker stopped at step {step}, latest checkpoint {mgr.latest_step()}", flush=True)
    """)
    cmd = [*CLI, "--nproc-per-node", "1", "--start-method", "fork", "--run-path", "--run-dir", str(run_dir),
           str(train), str(tmp_path)]
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[int] = []
    try:
        _wait_for(lambda: (tmp_path / "armed").exists(), 100, "the first step", agent, log)
        tree = [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
        assert "trainguard run: stopped by SIGTERM" in text
        assert "Unable to shutdown" not in text  # the worker that saved and returned was not left for SIGKILL
        ev = list(read_events(run_dir))
        exits = [e for e in ev if e["event"] == "agent_exit"]
        assert len(exits) == 1 and exits[0]["ok"] is False and exits[0]["signal"] == "SIGTERM", exits
        saves = [e for e in ev if e["event"] == "save"]
        assert saves and "worker stopped at step" in text  # the preemption save, then a clean stop
        assert f"latest checkpoint {saves[-1]['step']}" in text
        _wait_for(lambda: all(_gone(p) for p in tree), 10, "the worker to exit", log=log)
    finally:
        _kill_all([*tree, agent.pid])
        agent.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)


# ---------------------------------------------------------------- pause / resume / suspend


def test_watchdog_does_not_fire_while_paused_fires_after_resume_and_a_beat_clears_the_pause():
    fired = threading.Event()
    w = Watchdog(timeout=0.2, check_every=0.01)
    w._on_hang = lambda idle: fired.set()  # type: ignore[method-assign]  # record instead of exiting
    w.start()
    try:
        w.beat(1)
        w.pause()
        assert not fired.wait(1.0)  # 5 timeouts idle, paused: no hang
        w.resume()
        assert fired.wait(10)  # idle again after resume: a hang
        fired.clear()
        w.pause()
        gaps = list(w._gaps)
        w.beat(2)  # a beat ends the pause; the paused time is no step gap
        assert not w._paused and list(w._gaps) == gaps
        assert fired.wait(10)
    finally:
        w.stop()


def test_module_paused_and_suspend_act_on_the_process_watchdog(monkeypatch):
    class Heart:
        watchdog = Watchdog(timeout=1.0)  # not started: only its state is looked at

    monkeypatch.setattr(watchdog, "_HEART", None)
    with watchdog.paused():  # outside trainguard run: no-ops
        watchdog.suspend()
    monkeypatch.setattr(watchdog, "_HEART", Heart())
    wd = Heart.watchdog
    wd.beat(1)
    with pytest.raises(RuntimeError), watchdog.paused():
        assert wd._paused
        raise RuntimeError("a failed save")
    assert not wd._paused  # resumed on the way out of a failed save too
    before = wd._last
    watchdog.suspend()
    assert wd._paused and wd._last == before
    wd.beat(2)
    assert not wd._paused


@pytest.mark.slow  # suite time (~12 s: it must outlast the hang floor); in `make test-slow`
@pytest.mark.timeout(120)
def test_work_after_close_longer_than_the_hang_floor_is_no_hang(tmp_path):
    # Evaluation after training (CheckpointManager closed, no more heartbeats) for longer than the
    # hang floor: the job succeeds. The run dir already holds an earlier job's steps up to 50; they
    # are not this job's lost steps.
    run_dir, log = tmp_path / "run", tmp_path / "agent.log"
    _log_job(EventLog(run_dir / "events.jsonl", rank=-1), "an-earlier-job", range(0))
    for s in range(1, 51):
        EventLog(run_dir / "events.jsonl").emit("step", step=s, world_size=1)
    train = _script(tmp_path, "post_train.py", """\
        import os, time
        import torch
        import trainguard as tg
        model = torch.nn.Linear(4, 4)
        run = os.environ["TRAINGUARD_RUN_DIR"]
        with tg.CheckpointManager(os.path.join(run, "ck"), save=tg.EveryNSteps(5)) as mgr:
            for step in range(1, 13):
                time.sleep(0.02)
                mgr.save(step, {"model": model})
        print("training done; evaluating for 5 s", flush=True)
        end = time.monotonic() + 5  # evaluation / export / upload after training, no heartbeat
        while time.monotonic() < end:
            time.sleep(0.1)
        print("EVAL DONE", flush=True)
    """)
    cmd = [*CLI, "--nproc-per-node", "1", "--start-method", "fork", "--run-path", "--run-dir", str(run_dir),
           "--hang-floor", "3", "--max-restarts", "0", str(train)]
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = agent.wait(timeout=100)
        text = log.read_text(errors="replace")
        ev = list(read_events(run_dir))
        assert rc == 0 and "EVAL DONE" in text, text[-3000:]
        assert not [e for e in ev if e["event"] in ("hang", "failure")]
        first = [e for e in ev if e["event"] == "first_step"]
        assert [e["lost_steps"] for e in first] == [0], first  # was 50: the earlier job's steps
        starts = [e for e in ev if e["event"] == "agent_start"]
        assert starts[-1]["job_id"] and starts[-1]["job_id"] != "an-earlier-job"
    finally:
        _kill_all([agent.pid])
        agent.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
