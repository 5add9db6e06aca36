"""Review of the elastic / data-position path: each test reproduces a bug found there and failed
before its fix. Every process started here is bounded in time and killed by its pid."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

from conftest import run_py


def test_agent_fault_kills_the_agent_pid_not_the_parent():
    # With --start-method forkserver a worker's parent is the forkserver, not the agent: the
    # kind=agent drill killed the forkserver, the agent lived on and restarted its workers.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        worker = "from trainguard.elastic.faults import Fault, fire; fire(Fault(0, 0, 'agent'))"
        parent = (  # stands in for the forkserver: the worker's parent, but not its agent
            "import subprocess, sys; "
            f"print(subprocess.run([sys.executable, '-c', {worker!r}], timeout=60).returncode)"
        )
        p = run_py(["-c", parent], env={"TRAINGUARD_AGENT_PID": str(agent.pid)}, timeout=90)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == str(-signal.SIGKILL)  # the worker killed itself
        assert agent.wait(timeout=30) == -signal.SIGKILL  # and the agent
    finally:
        with contextlib.suppress(ProcessLookupError):
            agent.kill()
        agent.wait(timeout=30)
