"""Session 55 hunt (review55a): a hostile review of ``trainguard run``'s agent (real agents, real workers, c10d on
127.0.0.1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_elastic_edges import _wait_for
from test_hunt54_agent54 import SRC, _accepts, _agent, _cleanup, _free_port
from trainguard.events import read_events

# Node A's worker: exits 143 on SIGTERM (its preemption save done), after <dir>/stopA. Node B's worker: exits 143
# (a stop decided by another rank) once <dir>/release-B exists: a process teardown slower than A's.
HOST_PREEMPTED = """\
    import os, signal, sys, time
    d, name = sys.argv[1], sys.argv[2]
    if name == "A":
        signal.signal(signal.SIGTERM, lambda s, f: (open(os.path.join(d, "stopA"), "w").close(), os._exit(143)))
    with open(os.path.join(d, "up-" + name), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        if name == "B" and os.path.exists(os.path.join(d, "release-B")):
            sys.exit(143)
        time.sleep(0.05)
"""


def _two_agents(tmp_path: Path, script: str, rdzv_id: str) -> tuple[subprocess.Popen, Path, subprocess.Popen, Path, Path]:
    """Agent A (the rendezvous store's host) and agent B, ``--nnodes 2``, one worker of ``script`` each, both up."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(script))
    port, run_dir = _free_port(), tmp_path / "run"

    def start(name: str) -> tuple[subprocess.Popen, Path, Path]:
        return _agent(tmp_path, name, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--run-dir", str(run_dir),
                      str(train), str(tmp_path), name)

    a, log_a, _ = start("A")
    _wait_for(lambda: _accepts(port), 60, "agent A's rendezvous store", a, log_a)
    b, log_b, _ = start("B")
    _wait_for(lambda: (tmp_path / "up-A").exists() and (tmp_path / "up-B").exists(), 90, "both workers", b, log_b)
    return a, log_a, b, log_b, run_dir


@pytest.mark.timeout(150)
def test_the_store_hosts_preemption_is_143_on_a_node_whose_workers_end_later(tmp_path: Path) -> None:
    """Before: node A's agent (it hosts the c10d rendezvous store) SIGTERMed, a preemption of that node alone; its
    worker saved and exited 143, and the agent exited 143, taking the store with it. Node B's worker (the ranks stop
    together) was still ending (here released once A's agent had exited; a teardown 2 s slower than A's did it too):
    B's agent failed its next store read at once (``RendezvousConnectionError`` traceback), SIGTERMed its worker and
    exited 1, a crash to a requeue wrapper. Now B waits (bounded) for its worker's end: 143, a ``store_lost`` event."""
    a, log_a, b, log_b, run_dir = _two_agents(tmp_path, HOST_PREEMPTED, "hunt55a1")
    try:
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 128 + signal.SIGTERM, log_a.read_text(errors="replace")[-3000:]
        _wait_for(lambda: any(e["event"] == "store_lost" and e["pid"] == b.pid
                              for e in read_events(run_dir / "events.jsonl")) or b.poll() is not None,
                  30, "agent B to notice the store's loss", None, log_b)
        (tmp_path / "release-B").touch()
        rc = b.wait(timeout=60)
        text = log_b.read_text(errors="replace")
        assert rc == 128 + signal.SIGTERM, (rc, text[-3000:])
        assert "Traceback" not in text, text[-3000:]
        exits = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit" and e["pid"] == b.pid]
        assert [(e["signal"], e.get("preempted")) for e in exits] == [("SIGTERM", True)], exits
    finally:
        (tmp_path / "release-B").touch()
        _cleanup(a, b)


# A worker that notes how it found SIGHUP (<dir>/up: signal.getsignal's value, 1 = ignored), then waits for <dir>/go.
NOTES_SIGHUP = """\
    import os, signal, sys, time
    d = sys.argv[1]
    with open(os.path.join(d, "up"), "w") as f:
        f.write(str(int(signal.getsignal(signal.SIGHUP))))
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _delivered(pid: int, sig: int) -> bool:
    """Whether no ``sig`` is pending for process ``pid`` any more (the kernel delivered it)."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd", "ShdPnd"))]
    return not any(m & (1 << (sig - 1)) for m in masks)


@pytest.mark.timeout(120)
def test_a_nohup_agent_ignores_sighup_after_its_workers_started(tmp_path: Path) -> None:
    """Before: ``nohup trainguard run ...`` ignored SIGHUP only until its workers started: torch's ``PContext.start``
    installs its handler on every signal of its ``--signals-to-handle`` list (SIGHUP among them) whatever this
    process ignores, and the workers, started with the handler in place, had SIGHUP at its default. A logout (the
    shell's SIGHUP to its jobs) stopped the job: exit 129. Now an ignored SIGHUP stays ignored, in the workers too;
    the job runs on and ends 0."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(NOTES_SIGHUP))
    run_dir, tmp, log = tmp_path / "run", tmp_path / "tmp", tmp_path / "agent.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--nproc-per-node", "1", "--run-dir",
                                  str(run_dir), str(train), str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
                                 env=env, cwd=tmp_path, start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # nohup
    try:
        _wait_for(lambda: (tmp_path / "up").exists() and (tmp_path / "up").read_text(), 90, "the worker", agent, log)
        assert int((tmp_path / "up").read_text()) == int(signal.SIG_IGN)  # before: 0, SIG_DFL
        agent.send_signal(signal.SIGHUP)
        _wait_for(lambda: _delivered(agent.pid, signal.SIGHUP), 10, "SIGHUP's delivery", agent, log)
        (tmp_path / "go").touch()
        rc = agent.wait(timeout=60)
        assert rc == 0, (rc, log.read_text(errors="replace")[-3000:])
        assert [e["ok"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit"] == [True]
    finally:
        (tmp_path / "go").touch()
        _cleanup(agent)


# The agent, with a count of its open descriptors (after a full garbage collection) at each restart of its workers,
# appended to <argv[1]>; the rest of argv is trainguard run's.
COUNTING_AGENT = """\
    import gc, os, sys
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from trainguard.elastic import launcher
    out, hooks = sys.argv[1], launcher.install_agent_hooks

    def install(*args, **kwargs):
        hooks(*args, **kwargs)
        restart = SimpleElasticAgent._restart_workers

        def counted(self, wg):
            gc.collect()
            with open(out, "a") as f:
                f.write(f"{len(os.listdir('/proc/self/fd'))}\\n")
            return restart(self, wg)

        SimpleElasticAgent._restart_workers = counted

    launcher.install_agent_hooks = install
    sys.exit(launcher.main(sys.argv[2:]))
"""

# Both ranks fail (exit 1) together: rank 1 first, rank 0 as soon as it sees rank 1's note.
FAIL_TOGETHER = """\
    import os, sys, time
    d = os.path.join(sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"])
    os.makedirs(d, exist_ok=True)
    if os.environ["RANK"] == "1":
        open(os.path.join(d, "failed1"), "w").close()
        sys.exit(1)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, "failed1")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(1)
"""


@pytest.mark.timeout(240)
def test_the_agents_descriptors_do_not_grow_with_its_restarts(tmp_path: Path) -> None:
    """Before: the agent's ``ProcessContext.join`` hook gives an ended ``--run-path`` worker a ready descriptor (a
    pipe at EOF) in place of its sentinel; torch's ``join`` stops at the first failed worker it finds, and the other
    ended worker's descriptor stayed in the context, which was dropped at the restart with it open: the agent's open
    descriptors grew with its restarts (one per restart here: 28, 29, ..., 37). Now the context's close closes them:
    the count at the last restart is at most the count at the second."""
    agent_py, train = tmp_path / "agent.py", tmp_path / "train.py"
    agent_py.write_text(textwrap.dedent(COUNTING_AGENT))
    train.write_text(textwrap.dedent(FAIL_TOGETHER))
    counts, tmp, log = tmp_path / "fds", tmp_path / "tmp", tmp_path / "agent.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, str(agent_py), str(counts), "--nproc-per-node", "2", "--run-path",
                                  "--start-method", "fork", "--no-watchdog", "--monitor-interval", "0.5",
                                  "--max-restarts", "10", "--run-dir", str(tmp_path / "run"), str(train),
                                  str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                 start_new_session=True)
    try:
        rc = agent.wait(timeout=200)
        text = log.read_text(errors="replace")
        assert rc == 1, (rc, text[-3000:])
        seen = [int(x) for x in counts.read_text().split()]
        assert len(seen) == 10, (seen, text[-3000:])
        assert seen[-1] <= seen[1], seen  # before: [28, 29, ..., 37]
    finally:
        _cleanup(agent)


# The agent, with an exit hook (atexit, registered as the agent's hooks are installed) that says so
# (<argv[1]>/exiting) and waits for <argv[1]>/release (bounded): the interpreter's exit of a finished job, held open.
SLOW_EXIT_AGENT = """\
    import atexit, os, sys, time
    from trainguard.elastic import launcher
    d, hooks = sys.argv[1], launcher.install_agent_hooks

    def slow_exit():
        open(os.path.join(d, "exiting"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, "release")) and time.monotonic() < deadline:
            time.sleep(0.05)

    def install(*args, **kwargs):
        atexit.register(slow_exit)
        hooks(*args, **kwargs)

    launcher.install_agent_hooks = install
    sys.exit(launcher.main(sys.argv[2:]))
"""


@pytest.mark.timeout(120)
def test_a_sigterm_after_the_jobs_end_keeps_its_exit_code(tmp_path: Path) -> None:
    """Before: the agent's stop-signal handler stayed installed once the job had finished: a SIGTERM in the seconds
    of the agent's exit (its atexit calls, the interpreter's teardown) raised ``SignalException`` there (a
    traceback; seen in the temp log directory's removal, which it cut short and left the directory) or, once Python
    had put the defaults back, killed the agent (-15). Now it is reported and the job's exit code (0) kept."""
    agent_py, train = tmp_path / "agent.py", tmp_path / "train.py"
    agent_py.write_text(textwrap.dedent(SLOW_EXIT_AGENT))
    train.write_text("print('trained')\n")
    tmp, log = tmp_path / "tmp", tmp_path / "agent.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, str(agent_py), str(tmp_path), "--nproc-per-node", "1",
                                  "--run-dir", str(tmp_path / "run"), str(train)], stdout=out,
                                 stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "exiting").exists(), 90, "the agent's exit", agent, log)
        agent.send_signal(signal.SIGTERM)
        _wait_for(lambda: _delivered(agent.pid, signal.SIGTERM), 10, "SIGTERM's delivery", agent, log)
        (tmp_path / "release").touch()
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == 0, (rc, text[-3000:])
        assert "Traceback" not in text, text[-3000:]
        assert "SIGTERM after the job's end" in text, text[-3000:]
        assert not list(tmp.iterdir()), list(tmp.iterdir())
    finally:
        (tmp_path / "release").touch()
        _cleanup(agent)
