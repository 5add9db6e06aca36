"""Session 48's leftovers: small defects earlier sessions saw and left alone, each test checked
to fail on the code before its fix."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from trainguard.demo import driver
from trainguard.elastic.reap import running

# An "agent" that does not end on SIGTERM (as a SIGSTOPped or hung one), with a worker leading a
# session of its own (as trainguard run's --run-path workers do) and that worker's own child (a
# DataLoader process). It prints the two pids once SIGTERM is ignored.
_AGENT = r"""
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
loader = subprocess.Popen([sys.executable, "-c", "import time; [time.sleep(1) for _ in iter(int, 1)]"])
print(loader.pid, flush=True)
while True: time.sleep(1)
'''], start_new_session=True, stdout=subprocess.PIPE)
print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
while True: signal.pause()
"""


def test_demo_stop_kills_the_agents_workers_with_it():
    # The demo's stop() SIGKILLed an agent that had not ended on SIGTERM within its grace, alone:
    # its workers (own sessions) kept saving into the run directory after the demo removed it.
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE)
    pids: list[int] = []
    try:
        line = agent.stdout.readline().decode().split()
        assert len(line) == 2, line
        pids = [int(p) for p in line]
        assert all(running(p) for p in pids)
        driver.stop(agent, grace_s=0)
        assert agent.returncode == -signal.SIGKILL
        assert [p for p in pids if running(p)] == []
    finally:
        for p in [agent.pid, *pids]:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        agent.wait(timeout=30)
        agent.stdout.close()

