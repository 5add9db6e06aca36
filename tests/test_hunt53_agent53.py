"""Session 53 hunt (agent53): ``trainguard run``'s agent and ``BoundedStore`` (real agent processes,
real worker processes, c10d on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import trainguard as tg
from test_elastic_edges import _gone, _kill_all, _wait_for
from trainguard.storecall import BoundedStore

SRC = str(Path(tg.__file__).resolve().parent.parent)

# A worker that says it runs (<dir>/up<rank>), then idles (bounded) until the agent stops it.
IDLE_WORKER = """\
    import os, sys, time
    open(os.path.join(sys.argv[1], "up" + os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
"""

# The agent, with (1) a report of the threads still alive when its interpreter exits (its last atexit handler);
# (2) a slow keep-alive heartbeat: after its store call, once, it waits in another C++ store call (the GIL
# released, as in any heartbeat) until the test sets "go" on its own store (a rendezvous store slow to answer),
# <dir>/ka saying it is in that call.
AGENT_WITH_SLOW_KEEPALIVE = """\
import atexit, os, threading
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

OUT, PORT = os.environ["TG_TEST_OUT"], int(os.environ["TG_TEST_PORT"])
atexit.register(lambda: print("THREADS AT EXIT", sorted(t.name for t in threading.enumerate()
                                                       if t.is_alive() and t is not threading.main_thread()), flush=True))
orig = DynamicRendezvousHandler._keep_alive


def slow_keep_alive(self, orig=orig, path=os.path.join(OUT, "ka")):
    orig(self)
    if os.path.exists(path):
        return
    slow = dist.TCPStore("127.0.0.1", PORT, is_master=False, timeout=timedelta(seconds=60))
    open(path, "w").close()
    slow.wait(["go"])


DynamicRendezvousHandler._keep_alive = slow_keep_alive
from trainguard.cli import main

main()
"""


def _start_agent(tmp_path: Path, code: str, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONPATH": SRC}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, "-c", code, "run", *args], stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
    return agent, log


def _cleanup(agent: subprocess.Popen, tree: list[int]) -> None:
    _kill_all([*tree, agent.pid])
    with contextlib.suppress(subprocess.TimeoutExpired):
        agent.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(agent.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_sigterm_during_a_keepalive_heartbeat_exits_143_not_sigabrt(tmp_path: Path) -> None:
    """Before: on a stop signal torch's agent leaves the c10d rendezvous open and its keep-alive thread
    (``RendezvousKeepAliveTimer_*``, a store call every second) running. When the signal came while a heartbeat
    was in its store call, that thread held the rendezvous handler and the agent's interpreter exited around it:
    a call that returned during finalization ended the thread in pybind11's GIL guard, which aborted the process
    ("terminate called without an active exception", exit -6 (SIGABRT) instead of 143: 1 run in 12 of SIGTERM
    to a 1-worker agent on a loaded machine). Now the agent stops the thread and waits for its call (bounded:
    5 s) before it exits: no keep-alive thread is left at exit."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(IDLE_WORKER))
    agent_py = tmp_path / "agent.py"
    agent_py.write_text(AGENT_WITH_SLOW_KEEPALIVE)
    log = tmp_path / "agent.log"
    slow = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONPATH": SRC, "TG_TEST_OUT": str(tmp_path), "TG_TEST_PORT": str(slow.port)}
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, str(agent_py), "run", "--nproc-per-node", "1", "--run-dir",
                                  str(tmp_path / "run"), str(train), str(tmp_path)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tree: list[int] = []
    try:
        _wait_for(lambda: (tmp_path / "up0").exists() and (tmp_path / "ka").exists(), 60, "the heartbeat", agent, log)
        tree = [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]
        agent.send_signal(signal.SIGTERM)  # the heartbeat is in its store call
        _wait_for(lambda: "stopped by SIGTERM" in log.read_text(errors="replace"), 60, "the agent's exit", agent, log)
        slow.set("go", "1")  # the call returns (in the agent's exit, or during its interpreter's finalization)
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert "terminate called" not in text and rc == 128 + signal.SIGTERM, (rc, text[-3000:])
        line = next((x for x in text.splitlines() if x.startswith("THREADS AT EXIT")), None)
        assert line is not None and "KeepAlive" not in line, text[-3000:]
        _wait_for(lambda: all(_gone(p) for p in tree), 10, "the worker to exit", log=log)
    finally:
        _cleanup(agent, tree)


class _GatedStore:
    """A store whose calls block until the test opens the gate (bounded), as a store call in flight."""

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.in_call, self.data = 0, {}

    def _enter(self, hold: float) -> None:
        self.in_call += 1
        self.entered.set()
        try:
            self.gate.wait(hold)
        finally:
            self.in_call -= 1

    def get(self, key: str) -> bytes:
        self._enter(10)
        return self.data.get(key, b"")

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self._enter(1)  # returns by itself after 1 s: the call close(wait) must outwait
        return True


def test_a_call_after_close_keeps_one_worker_and_close_wait_joins_the_one_in_the_store(monkeypatch) -> None:
    """Before: ``close()`` forgot its worker at once; a call before that worker took the stop started a
    second one on the same queue (two threads calling the store at once), the stop went to either, and a
    later ``close(wait)`` joined the one that had ended while the other was still inside a store call (the
    exit hook's wait, meant to keep store calls out of the interpreter's finalization, did not wait)."""
    workers: list[int] = []
    orig_work, orig_put = BoundedStore._work, BoundedStore._put
    raw = _GatedStore()
    set_queued = threading.Event()

    def work(self: BoundedStore) -> None:
        workers.append(threading.get_ident())
        orig_work(self)

    def put(self: BoundedStore, call) -> None:
        orig_put(self, call)
        if call.fn == raw.set:
            set_queued.set()

    monkeypatch.setattr(BoundedStore, "_work", work)
    monkeypatch.setattr(BoundedStore, "_put", put)
    bs = BoundedStore(raw, bound=20)
    got: list[bytes] = []
    first = threading.Thread(target=lambda: got.append(bs.get("a")), daemon=True)
    first.start()
    assert raw.entered.wait(10)  # the worker is inside the store's get
    bs.close()
    later = threading.Thread(target=bs.set, args=("b", "1"), daemon=True)  # after close(), the stop still queued
    later.start()
    assert set_queued.wait(10)
    raw.gate.set()
    first.join(10)
    later.join(10)
    assert got == [b""] and raw.data == {"b": b"1"}
    assert len(workers) == 1, f"{len(workers)} worker threads for one store"
    raw.gate.clear()
    raw.entered.clear()
    checker = threading.Thread(target=bs.check, args=(["k"],), daemon=True)
    checker.start()
    assert raw.entered.wait(10)  # a call in flight (it returns after 1 s)
    bs.close(wait=15)
    assert raw.in_call == 0, "close(wait) returned while its worker was still inside a store call"
    assert not any(t.name == "trainguard-store" and t.is_alive() for t in threading.enumerate() if t.ident in workers)
    checker.join(10)
    raw.gate.set()
    assert bs.get("b") == b"1"  # after the worker ended, a call starts one again
    bs.close(wait=5)


RAISING_WORKER = """\
    import os, time
    import trainguard  # noqa: F401  (its excepthook writes torch's error file)

    def inner():
        raise ValueError("boom on rank " + os.environ["RANK"])

    if os.environ["RANK"] == "1":
        inner()
    time.sleep(30)  # rank 0: until the agent stops it
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run_path", [False, True], ids=["script", "run-path"])
def test_failure_event_carries_the_failed_workers_traceback(tmp_path: Path, run_path: bool) -> None:
    """Before: the agent's ``failure`` event said "exit code 1" and no more; a script worker's traceback was
    only in its stderr (torch's report: "To enable traceback see ..."). Now the event has the traceback's
    last 4 KB (``traceback``); its other fields, and ``trainguard report``'s reading, are unchanged."""
    from trainguard.events import read_events
    from trainguard.report import summarize

    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(RAISING_WORKER))
    run_dir = tmp_path / "run"
    agent, log = _start_agent(tmp_path, "from trainguard.cli import main; main()", "--nproc-per-node", "2",
                              "--max-restarts", "0", *(["--run-path"] if run_path else []),
                              "--run-dir", str(run_dir), str(train))
    try:
        rc = agent.wait(timeout=100)
    finally:
        _cleanup(agent, [])
    text = log.read_text(errors="replace")
    assert rc == 1, text[-3000:]
    events = list(read_events(run_dir / "events.jsonl"))
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1, failures
    f = failures[0]
    assert f["rank"] == 1 and f["cause"] == "exit code 1" and f["failures"]["1"] == "exit code 1", f
    assert "ValueError: boom on rank 1" in f["traceback"] and 'line 5, in inner' in f["traceback"], f["traceback"]
    assert len(f["traceback"]) <= 4096
    s = summarize(events)
    assert s["failures"] == 1 and s["recoveries"][0]["cause"] == "exit code 1", s
    exit_event = [e for e in events if e["event"] == "agent_exit"][-1]
    assert "ValueError: boom on rank 1" in exit_event["error"], exit_event  # torch's report of it too


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_failed_job_says_how_many_restarts_it_had(tmp_path: Path, restarts: int) -> None:
    """Before: "the job failed after its restarts" whatever the count, with ``--max-restarts 0`` too (none tried)."""
    from trainguard.events import read_events

    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(RAISING_WORKER))
    run_dir = tmp_path / "run"
    agent, log = _start_agent(tmp_path, "from trainguard.cli import main; main()", "--nproc-per-node", "2",
                              "--max-restarts", str(restarts), "--run-dir", str(run_dir), str(train))
    try:
        rc = agent.wait(timeout=100)
    finally:
        _cleanup(agent, [])
    text = log.read_text(errors="replace")
    assert rc == 1, text[-3000:]
    word = "restart" if restarts == 1 else "restarts"
    assert f"the job failed after {restarts} {word} (--max-restarts {restarts})" in text, text[-2000:]
    kinds = [e["event"] for e in read_events(run_dir / "events.jsonl")]
    assert kinds.count("restart") == restarts and kinds.count("failure") == restarts + 1, kinds


SAVING_WORKER = """\
    import os, sys, time
    import torch
    import trainguard as tg

    model = torch.nn.Linear(4, 4)
    deadline = time.monotonic() + 60
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(10**6)) as mgr:
        step = 0
        while not mgr.should_stop and time.monotonic() < deadline:
            step += 1
            time.sleep(0.02)
            mgr.save(step, {"model": model})
            if step == 1:
                open(os.path.join(sys.argv[1], "armed"), "w").close()
    print(f"worker stopped at step {step}", flush=True)
"""


@pytest.mark.timeout(120)
def test_sigterm_to_the_agent_leaves_no_stop_note_in_the_run_directory(tmp_path: Path) -> None:
    """Before: a worker that saved and stopped on the agent's SIGTERM notes it in the agent's stop file
    (``<run dir>/.trainguard/stopped-<host>-<agent pid>``); the agent read and removed it when the job ended
    otherwise, but exited on the signal without: one file left in the run directory per preemption."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(SAVING_WORKER))
    run_dir = tmp_path / "run"
    agent, log = _start_agent(tmp_path, "from trainguard.cli import main; main()", "--nproc-per-node", "1",
                              "--run-dir", str(run_dir), str(train), str(tmp_path))
    tree: list[int] = []
    try:
        _wait_for(lambda: (tmp_path / "armed").exists(), 60, "the first step", agent, log)
        tree = [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert rc == 128 + signal.SIGTERM and "worker stopped at step" in text, text[-3000:]
        stopped = int(text.split("worker stopped at step")[1].split()[0])
        assert tg.CheckpointManager(run_dir).latest_step() == stopped  # it saved on the signal
        left = sorted(p.name for p in (run_dir / ".trainguard").iterdir() if p.name.startswith("stopped-"))
        assert left == [], left
    finally:
        _cleanup(agent, tree)
