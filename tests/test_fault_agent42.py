"""The ``agent`` drill (a lost node) ends the worker's DataLoader processes with it: before, it
SIGKILLed the agent and the worker only, and the worker's loader processes lived ~5 s on (until
torch's loader watchdog saw their parent gone)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from trainguard.elastic import faults, reap
from trainguard.elastic.faults import Fault


def test_the_agent_drill_kills_the_agent_then_the_loader_processes_then_the_worker(monkeypatch):
    done: list[tuple[str, int]] = []
    seen: list[tuple[str, int, int]] = []  # every kill of the agent or this process, from any thread
    monkeypatch.setenv("TRAINGUARD_AGENT_PID", "424242")
    real_kill, me = os.kill, os.getpid()

    def kill(pid: int, sig: int) -> None:  # the agent's and this process's kills are recorded, others done
        if pid in (424242, me):
            seen.append((threading.current_thread().name, pid, sig))
            if threading.current_thread() is threading.main_thread() and sig == signal.SIGKILL:
                done.append(("kill", pid))  # the drill's: a thread an earlier test of this worker left
        else:  # may probe this process (a liveness check, signal 0) at any time (CI, once)
            real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    child.start()  # a DataLoader worker of this "worker"
    try:
        faults.fire(Fault(step=1, rank=0, kind="agent"))
        child.join(30)
        assert child.exitcode == -signal.SIGKILL  # ended by the drill (reap.end_children)
        assert done == [("kill", 424242), ("kill", me)], seen
    finally:
        if child.is_alive():
            child.kill()


def test_the_children_go_after_the_agent_and_before_the_worker(monkeypatch):
    order: list[str] = []
    monkeypatch.setenv("TRAINGUARD_AGENT_PID", "424242")
    monkeypatch.setattr(os, "kill", lambda pid, sig: order.append("agent" if pid == 424242 else "self")
                        if threading.current_thread() is threading.main_thread() else None)
    monkeypatch.setattr(reap, "end_children", lambda: order.append("children"))
    faults.fire(Fault(step=1, rank=0, kind="agent"))
    assert order == ["agent", "children", "self"]
