"""Session 54 hunt (agent54): stop signals to ``trainguard run``'s agent where torch's handler does not run or
waits too long (real agent processes, real workers, c10d on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import trainguard as tg
from test_elastic_edges import _gone, _kill_all, _wait_for
from trainguard.events import read_events

SRC = str(Path(tg.__file__).resolve().parent.parent)

# A worker that says it runs (<dir>/up-<name>, its pid), then idles (bounded); with name "A" it exits 0 once
# <dir>/go exists.
NAMED_WORKER = """\
    import os, sys, time
    d, name = sys.argv[1], sys.argv[2]
    with open(os.path.join(d, "up-" + name), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if name == "A" and os.path.exists(os.path.join(d, "go")):
            sys.exit(0)
        time.sleep(0.05)
"""

# Rank 0 ignores SIGTERM; the first one it gets (the agent's, in its failure close after rank 1 failed) it
# passes on to the agent: a SIGTERM to the agent within its failure grace. Rank 1 fails once rank 0 runs.
FAIL_WITH_DEAF_PEER = """\
    import os, signal, sys, time
    d = sys.argv[1]
    if os.environ["RANK"] == "0":
        def on_term(signum, frame):
            if not os.path.exists(os.path.join(d, "term0")):
                open(os.path.join(d, "term0"), "w").close()
                os.kill(int(os.environ["TRAINGUARD_AGENT_PID"]), signal.SIGTERM)
        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join(d, "up0"), "w").close()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, "up0")) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _agent(tmp_path: Path, name: str, *args: str, **env_extra: str) -> tuple[subprocess.Popen, Path, Path]:
    """``python -m trainguard run ARGS`` in a session of its own, its temp directory ``<tmp>/tmp-<name>``;
    returns the process, its log and that temp directory."""
    tmp, log = tmp_path / f"tmp-{name}", tmp_path / f"agent-{name}.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp), **env_extra}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trainguard", "run", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=tmp_path)
    return proc, log, tmp


def _cleanup(*agents: subprocess.Popen) -> None:
    for agent in agents:
        with contextlib.suppress(psutil.NoSuchProcess):
            _kill_all([c.pid for c in psutil.Process(agent.pid).children(recursive=True)])
        _kill_all([agent.pid])
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)


def _exits(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="SIGTERM"),  # SIGINT (the same path): `make test-slow`
                                 pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow)])
def test_stop_signal_while_waiting_for_peers_in_the_first_rendezvous(tmp_path: Path, sig) -> None:
    """Before: torch installs the agent's stop-signal handlers only when it starts workers. An agent in its first
    rendezvous (``--nnodes 2``, its peer not started) died of SIGTERM's default action (returncode -15, no
    ``agent_exit`` event, its ``trainguard-logs-*`` directory left in the temp directory), and SIGINT ended it with a
    ``KeyboardInterrupt`` traceback (exit 1). Now: ``agent_exit``, 128 + the signal, nothing left in the temp dir."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(NAMED_WORKER))
    port, run_dir = _free_port(), tmp_path / "run"
    agent, log, tmp = _agent(tmp_path, "A", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hunt54a", "--run-dir",
                             str(run_dir), str(train), str(tmp_path), "A")
    try:
        _wait_for(lambda: _accepts(port), 60, "the agent's rendezvous store", agent, log)  # it waits for node 2
        agent.send_signal(sig)
        rc = agent.wait(timeout=30)
        text = log.read_text(errors="replace")
        assert rc == 128 + sig, (rc, text[-3000:])
        assert "Traceback" not in text, text[-3000:]
        assert [e["signal"] for e in _exits(run_dir)] == [signal.Signals(sig).name]
        assert not list(tmp.iterdir()), list(tmp.iterdir())  # its log directory was removed
        assert not (tmp_path / "up-A").exists()
    finally:
        _cleanup(agent)


@pytest.mark.timeout(90)
def test_sigterm_while_the_agent_is_inside_a_cpp_store_connect(tmp_path: Path) -> None:
    """Before: a SIGTERM while the agent's main thread was inside a C++ ``TCPStore`` connect of its first rendezvous
    (``is_host=false``, an endpoint that accepts but never answers) killed it by the signal's default action
    (-15, no ``agent_exit``, its temp log directory left); with torch's handler installed from the start (session 53,
    taken back) it waited for the call's 60 s timeout, since a Python handler runs only when the main thread comes
    back to the interpreter. Now a thread that sees the signal (``signal.set_wakeup_fd``) ends the agent when its
    main thread does not take it up: ``agent_exit``, 143, the temp directory removed."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(NAMED_WORKER))
    run_dir = tmp_path / "run"
    with socket.socket() as mute:  # a store endpoint that accepts and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        mute.settimeout(60)
        port = mute.getsockname()[1]
        agent, log, tmp = _agent(tmp_path, "A", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hunt54b", "--rdzv-conf",
                                 "is_host=false", "--run-dir", str(run_dir), str(train), str(tmp_path), "A")
        try:
            conn, _ = mute.accept()  # the agent connected: its main thread waits in C++ for the store's answer
            with conn:
                agent.send_signal(signal.SIGTERM)
                rc = agent.wait(timeout=30)
            text = log.read_text(errors="replace")
            assert rc == 128 + signal.SIGTERM, (rc, text[-3000:])
            exits = _exits(run_dir)
            assert [e["signal"] for e in exits] == ["SIGTERM"], exits
            assert not list(tmp.iterdir()), list(tmp.iterdir())
        finally:
            _cleanup(agent)


def _two_agents(tmp_path: Path, rdzv_id: str) -> tuple[subprocess.Popen, Path, subprocess.Popen, Path, Path]:
    """Agent A (the rendezvous store's host) and agent B, ``--nnodes 2``, one ``NAMED_WORKER`` each, both running."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(NAMED_WORKER))
    port, run_dir = _free_port(), tmp_path / "run"

    def start(name: str) -> tuple[subprocess.Popen, Path, Path]:
        return _agent(tmp_path, name, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--run-dir", str(run_dir),
                      str(train), str(tmp_path), name, LOGLEVEL="INFO")  # torch's "Waiting 300 seconds" line

    a, log_a, _ = start("A")
    _wait_for(lambda: _accepts(port), 60, "agent A's rendezvous store", a, log_a)
    b, log_b, _ = start("B")
    _wait_for(lambda: (tmp_path / "up-A").exists() and (tmp_path / "up-B").exists(), 60, "both workers", b, log_b)
    return a, log_a, b, log_b, run_dir


@pytest.mark.timeout(120)
def test_sigterm_in_the_exit_barrier_ends_the_agent(tmp_path: Path) -> None:
    """Before: an agent whose workers finished waits in torch's exit barrier (a C++ store wait, 300 s) for the other
    agents; a SIGTERM there was not acted on until that wait ended (over 4 minutes seen). Now it exits 143 at once."""
    a, log_a, b, log_b, run_dir = _two_agents(tmp_path, "hunt54c")
    try:
        worker_a = int((tmp_path / "up-A").read_text())
        (tmp_path / "go").touch()  # A's worker exits 0; B's runs on: A waits for B in the exit barrier
        _wait_for(lambda: _gone(worker_a), 30, "A's worker to exit", a, log_a)
        _wait_for(lambda: "Waiting 300 seconds for other agents" in log_a.read_text(errors="replace"), 30,
                  "agent A in its exit barrier", a, log_a)
        a.send_signal(signal.SIGTERM)
        rc = a.wait(timeout=30)
        assert rc == 128 + signal.SIGTERM, (rc, log_a.read_text(errors="replace")[-3000:])
        assert "SIGTERM" in [e.get("signal") for e in _exits(run_dir) if e["pid"] == a.pid]
        assert b.poll() is None  # B is not affected (its worker still runs)
    finally:
        _cleanup(a, b)


@pytest.mark.slow  # two agents and the barrier's 2 s confirmation: ~20-23 s here
@pytest.mark.timeout(120)
def test_exit_barrier_ends_when_the_peer_agent_is_gone(tmp_path: Path) -> None:
    """Before: agent B SIGTERMed (exit 143), then agent A's worker finished: A waited torch's full exit barrier
    (300 s) for B, which had left for good. Now A sees B's rendezvous heartbeat stop (keep-alive: 3 s) and
    ends its barrier once that lasted 2 s: exit 0 (its own workers succeeded) within seconds, an ``exit_barrier``
    event."""
    a, log_a, b, log_b, run_dir = _two_agents(tmp_path, "hunt54d")
    try:
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=30) == 128 + signal.SIGTERM, log_b.read_text(errors="replace")[-3000:]
        (tmp_path / "go").touch()
        rc = a.wait(timeout=40)
        assert rc == 0, (rc, log_a.read_text(errors="replace")[-3000:])
        cut = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "exit_barrier" and e["pid"] == a.pid]
        assert len(cut) == 1 and cut[0]["gone"] == 1, cut
    finally:
        _cleanup(a, b)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("run_path", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["script", "run-path"])
def test_sigterm_during_the_failure_grace_logs_the_failure_and_exits_promptly(tmp_path: Path, run_path: bool) -> None:
    """Before: a SIGTERM to the agent while it closed the peers of a failed worker (its 1 s grace) raised out of
    that close: no ``failure`` event, and the peer that ignores SIGTERM was left to the agent's signal path, which
    waits the 30 s shutdown timeout before SIGKILL. Now the close ends as it would (SIGKILL after the grace), the
    ``failure`` event is logged, then the agent acts on the signal: 143, no restart."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(FAIL_WITH_DEAF_PEER))
    run_dir = tmp_path / "run"
    agent, log, tmp = _agent(tmp_path, "A", "--nproc-per-node", "2", *(["--run-path"] if run_path else []),
                             "--run-dir", str(run_dir), str(train), str(tmp_path))
    try:  # spawned --run-path workers import torch: up to ~20 s on a loaded 2-core machine
        _wait_for(lambda: (tmp_path / "term0").exists(), 60, "the agent's SIGTERM to rank 0", agent, log)
        rc = agent.wait(timeout=20)  # the agent got its SIGTERM inside the failure close; before: 30 s more
        text = log.read_text(errors="replace")
        assert rc == 128 + signal.SIGTERM, (rc, text[-3000:])
        events = list(read_events(run_dir / "events.jsonl"))
        failures = [e for e in events if e["event"] == "failure"]
        assert [f["rank"] for f in failures] == [1], failures
        assert not [e for e in events if e["event"] == "restart"], events
        assert [e["signal"] for e in events if e["event"] == "agent_exit"] == ["SIGTERM"]
        assert not list(tmp.iterdir()), list(tmp.iterdir())
    finally:
        _cleanup(agent)


# A worker that handles SIGTERM itself and trains on: once it got one (<dir>/got), it runs 3 s more, then ends (0).
TRAINS_ON_AFTER_SIGTERM = """\
    import os, signal, sys, time
    d = sys.argv[1]
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(time.monotonic()))
    with open(os.path.join(d, "up0"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (got and time.monotonic() > got[0] + 3):
        if got and not os.path.exists(os.path.join(d, "got")):
            open(os.path.join(d, "got"), "w").close()
        time.sleep(0.05)
"""


@pytest.mark.timeout(90)
def test_a_forked_workers_own_signal_does_not_end_its_agent(tmp_path: Path) -> None:
    """A worker forked from the agent (``--start-method fork``) inherits Python's wakeup fd, which the agent's signal
    watcher reads: the worker's own handled SIGTERM would have read as one to the agent, whose handler never ran, and
    the watcher would have ended the agent (143) 2 s later. The fork hook turns the fd off in the child: the worker
    trains on and the job ends 0."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(TRAINS_ON_AFTER_SIGTERM))
    run_dir = tmp_path / "run"
    agent, log, _ = _agent(tmp_path, "A", "--nproc-per-node", "1", "--run-path", "--start-method", "fork",
                           "--no-preload", "--no-watchdog", "--run-dir", str(run_dir), str(train), str(tmp_path))
    try:
        _wait_for(lambda: (tmp_path / "up0").exists() and (tmp_path / "up0").read_text(), 60, "the worker", agent, log)
        os.kill(int((tmp_path / "up0").read_text()), signal.SIGTERM)
        _wait_for(lambda: (tmp_path / "got").exists(), 30, "the worker's handler", agent, log)
        rc = agent.wait(timeout=60)
        assert rc == 0, (rc, log.read_text(errors="replace")[-3000:])
        assert [e["ok"] for e in _exits(run_dir)] == [True]
    finally:
        _cleanup(agent)
