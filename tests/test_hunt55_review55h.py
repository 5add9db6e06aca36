"""Session 55 hunt (review55h): a hostile review of review55a's agent changes (storelost, handled_names,
after_result, close_ready) with real agents and workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from test_elastic_edges import _wait_for
from test_hunt54_agent54 import SRC, _cleanup
from test_hunt55_review55a import _delivered, _two_agents
from trainguard.events import read_events

# The agent, with an exit hook (atexit, registered as the agent's hooks are installed) that says so
# (<argv[1]>/exiting), then waits in one C call (libc's system(): it does not return on a signal) for
# <argv[1]>/release and 4 s more: a finished job's exit held in C code (torch's teardown) past sigwatch's 2 s.
C_EXIT_AGENT = """\
    import atexit, ctypes, os, sys
    from trainguard.elastic import launcher
    d, hooks = sys.argv[1], launcher.install_agent_hooks

    def slow_exit():
        open(os.path.join(d, "exiting"), "w").close()
        release = os.path.join(d, "release")
        ctypes.CDLL(None).system(f"for i in $(seq 1200); do [ -e {release} ] && break; sleep 0.05; done; sleep 4".encode())

    def install(*args, **kwargs):
        atexit.register(slow_exit)
        hooks(*args, **kwargs)

    launcher.install_agent_hooks = install
    sys.exit(launcher.main(sys.argv[2:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [0, 1], ids=["finished", "failed"])
def test_a_sigterm_in_a_c_call_of_the_exit_keeps_the_jobs_exit_code(tmp_path: Path, code: int) -> None:
    """Before: after the job's result (``agent_exit`` logged), a SIGTERM while the agent's main thread was inside a
    call that does not return on a signal for over 2 s of its exit was taken by sigwatch's watcher thread: a
    second ``agent_exit`` (``signal: SIGTERM``) and exit 143, a failed job's 1 (and a permanent error's 78) turned
    into a preemption to a requeue wrapper. Now the watcher stands down once the result is known: the job's exit
    code, one ``agent_exit``, the signal reported."""
    agent_py, train = tmp_path / "agent.py", tmp_path / "train.py"
    agent_py.write_text(textwrap.dedent(C_EXIT_AGENT))
    train.write_text(f"import sys\nsys.exit({code})\n")
    tmp, log, run_dir = tmp_path / "tmp", tmp_path / "agent.log", tmp_path / "run"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, str(agent_py), str(tmp_path), "--nproc-per-node", "1",
                                  "--max-restarts", "0", "--run-dir", str(run_dir), str(train)], stdout=out,
                                 stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "exiting").exists(), 90, "the agent's exit", agent, log)
        agent.send_signal(signal.SIGTERM)
        _wait_for(lambda: _delivered(agent.pid, signal.SIGTERM), 10, "SIGTERM's delivery", agent, log)
        (tmp_path / "release").touch()
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == code, (rc, text[-3000:])  # before: 143
        exits = [(e["ok"], e.get("signal")) for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit"]
        assert exits == [(code == 0, None)], exits  # before: a second one, (False, "SIGTERM")
        assert f"SIGTERM after the job's end; exiting with {code}" in text, text[-3000:]
    finally:
        (tmp_path / "release").touch()
        _cleanup(agent)


@pytest.mark.timeout(120)
def test_a_sigusr1_given_to_handle_after_the_jobs_end_is_reported(tmp_path: Path) -> None:
    """Before: ``after_result`` covered SIGTERM, SIGINT, SIGHUP and SIGQUIT only. With ``--signals-to-handle
    SIGTERM,SIGUSR1`` (torch's help suggests SIGUSR1 for Slurm), a SIGUSR1 in the agent's exit of a finished job
    still met torch's handler: ``SignalException`` raised in the atexit call it came in (``Exception ignored in
    atexit callback``, a traceback, that call cut short). Now it is reported as SIGTERM is, the exit code kept."""
    from test_hunt55_review55a import SLOW_EXIT_AGENT

    agent_py, train = tmp_path / "agent.py", tmp_path / "train.py"
    agent_py.write_text(textwrap.dedent(SLOW_EXIT_AGENT))
    train.write_text("print('trained')\n")
    tmp, log, run_dir = tmp_path / "tmp", tmp_path / "agent.log", tmp_path / "run"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, str(agent_py), str(tmp_path), "--nproc-per-node", "1",
                                  "--signals-to-handle", "SIGTERM,SIGUSR1", "--run-dir", str(run_dir), str(train)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "exiting").exists(), 90, "the agent's exit", agent, log)
        agent.send_signal(signal.SIGUSR1)
        _wait_for(lambda: _delivered(agent.pid, signal.SIGUSR1), 10, "SIGUSR1's delivery", agent, log)
        (tmp_path / "release").touch()
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == 0, (rc, text[-3000:])
        assert "Traceback" not in text, text[-3000:]  # before: SignalException in the atexit call
        assert "SIGUSR1 after the job's end; exiting with 0" in text, text[-3000:]
        assert [e["ok"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit"] == [True]
    finally:
        (tmp_path / "release").touch()
        _cleanup(agent)


# Each node's worker: up-<name> (its pid), then idles (bounded); exits 1 once <dir>/fail-<name> exists.
FAILS_ON_NOTE = """\
    import os, sys, time
    d, name = sys.argv[1], sys.argv[2]
    with open(os.path.join(d, "up-" + name), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(d, "fail-" + name)):
            sys.exit(1)
        time.sleep(0.05)
"""


@pytest.mark.timeout(150)
def test_a_node_whose_workers_fail_after_the_store_is_lost_logs_agent_exit(tmp_path: Path) -> None:
    """Before: node A (its agent hosts the c10d rendezvous store) lost (agent and worker SIGKILLed); node B's agent
    logged ``store_lost`` and waited for its worker, which then failed (exit 1): the restart's rendezvous failed on
    the lost store, and B's agent ended with a ``RendezvousConnectionError`` traceback of 60 lines and exit 1, no
    ``agent_exit`` in the run's events (the same after the 30 s grace with workers that do not end). Now: exit 1,
    one ``agent_exit`` (``ok: false``, the error), one line that says so, no traceback."""
    a, _, b, log_b, run_dir = _two_agents(tmp_path, FAILS_ON_NOTE, "hunt55h1")
    try:
        for pid in [c.pid for c in psutil.Process(a.pid).children(recursive=True)] + [a.pid]:
            os.kill(pid, signal.SIGKILL)  # node A lost
        a.wait(timeout=10)
        _wait_for(lambda: any(e["event"] == "store_lost" and e["pid"] == b.pid
                              for e in read_events(run_dir / "events.jsonl")) or b.poll() is not None,
                  30, "agent B to notice the store's loss", None, log_b)
        (tmp_path / "fail-B").touch()
        rc = b.wait(timeout=90)
        text = log_b.read_text(errors="replace")
        assert rc == 1, (rc, text[-3000:])
        exits = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit" and e["pid"] == b.pid]
        assert [e["ok"] for e in exits] == [False], (exits, text[-3000:])  # before: []
        assert "Traceback" not in text, text[-3000:]
        assert "trainguard run: the rendezvous failed" in text, text[-3000:]
    finally:
        (tmp_path / "fail-B").touch()
        _cleanup(a, b)


@pytest.mark.timeout(120)
def test_a_nohup_agent_given_only_sighup_to_handle_still_ignores_it(tmp_path: Path) -> None:
    """Before: ``nohup trainguard run --signals-to-handle SIGHUP ...``: every signal given was ignored, and
    ``handled_names`` then gave torch the list unchanged: torch installed its handler on SIGHUP when it started the
    workers (which had SIGHUP at its default), and a logout's SIGHUP stopped the job (exit 129). Now torch gets an
    empty list (no warning traceback for it): SIGHUP stays ignored, in the worker too; the job ends 0."""
    from test_hunt55_review55a import NOTES_SIGHUP

    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(NOTES_SIGHUP))
    run_dir, tmp, log = tmp_path / "run", tmp_path / "tmp", tmp_path / "agent.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--nproc-per-node", "1",
                                  "--signals-to-handle", "SIGHUP", "--run-dir", str(run_dir), str(train),
                                  str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                 start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # nohup
    try:
        _wait_for(lambda: (tmp_path / "up").exists() and (tmp_path / "up").read_text(), 90, "the worker", agent, log)
        assert int((tmp_path / "up").read_text()) == int(signal.SIG_IGN)  # before: 0, SIG_DFL
        agent.send_signal(signal.SIGHUP)
        _wait_for(lambda: _delivered(agent.pid, signal.SIGHUP), 10, "SIGHUP's delivery", agent, log)
        (tmp_path / "go").touch()
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == 0, (rc, text[-3000:])  # before: 129
        assert "Traceback" not in text, text[-3000:]
    finally:
        (tmp_path / "go").touch()
        _cleanup(agent)
