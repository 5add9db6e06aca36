"""Session 54 hunt (review54e): a hostile review of agent54's stop-signal watcher and exit barrier (real agents,
real workers, c10d on 127.0.0.1)."""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from test_elastic_edges import _wait_for
from test_hunt54_agent54 import _accepts, _agent, _cleanup, _free_port
from trainguard.events import read_events

# A worker that says it runs (<dir>/up-<name>, its pid), then idles (bounded) until <dir>/go-<name> exists: exit 0.
GATED_WORKER = """\
    import os, sys, time
    d, name = sys.argv[1], sys.argv[2]
    with open(os.path.join(d, "up-" + name), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(d, "go-" + name)):
            sys.exit(0)
        time.sleep(0.05)
"""


def _until(cond, timeout: float) -> bool:
    """Poll ``cond`` until true or ``timeout`` s passed; whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _heartbeats(port: int, rdzv_id: str) -> set[str]:
    """The nodes with a heartbeat in the c10d rendezvous state (``addr_pid_localid``), read from the store."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    state = pickle.loads(base64.b64decode(store.get("torch.rendezvous." + rdzv_id)))
    return {str(n) for n in state.last_heartbeats}


@pytest.mark.slow  # two agents, a 3 s stall and an 8 s check that A still waits: ~30 s here
@pytest.mark.timeout(150)
def test_a_peer_whose_heartbeat_stalled_once_is_still_waited_for(tmp_path: Path) -> None:
    """Before: torch's keep-alive op sends a heartbeat only while the node's last one is still in the rendezvous
    state; a sync on any node drops one older than 3 s and writes that back. Agent B's keep-alive stalled once for
    3 s (here: B's agent SIGSTOPped, then continued; its worker trained on) and B never sent a heartbeat again.
    When agent A's worker finished, A's exit barrier took B for gone after 2 s and A (the store's host) exited 0
    while B still trained; B's agent then died of ``RendezvousConnectionError`` (exit 1): a job that would have
    succeeded failed. Now a live agent puts its dropped heartbeat back: A waits for B, both exit 0."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(GATED_WORKER))
    port, run_dir, rdzv_id = _free_port(), tmp_path / "run", "hunt54e1"

    def start(name: str) -> tuple[subprocess.Popen, Path, Path]:
        return _agent(tmp_path, name, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--run-dir", str(run_dir),
                      str(train), str(tmp_path), name, LOGLEVEL="INFO")

    a, log_a, _ = start("A")
    b = None
    try:
        _wait_for(lambda: _accepts(port), 60, "agent A's rendezvous store", a, log_a)
        b, log_b, _ = start("B")
        _wait_for(lambda: (tmp_path / "up-A").exists() and (tmp_path / "up-B").exists(), 60, "both workers", b, log_b)
        node_b = next(n for n in _heartbeats(port, rdzv_id) if f"_{b.pid}_" in n)
        os.kill(b.pid, signal.SIGSTOP)  # B's agent stalls (its worker runs on) until A's sync dropped its heartbeat
        try:
            _wait_for(lambda: node_b not in _heartbeats(port, rdzv_id), 30, "B's heartbeat dropped", a, log_a)
        finally:
            os.kill(b.pid, signal.SIGCONT)
        _until(lambda: node_b in _heartbeats(port, rdzv_id), 10)  # B is back (before: its heartbeat never was)
        (tmp_path / "go-A").touch()  # A's worker ends: A waits for B (still training) in its exit barrier
        _wait_for(lambda: "Waiting 300 seconds for other agents" in log_a.read_text(errors="replace"), 30,
                  "agent A in its exit barrier", a, log_a)
        with pytest.raises(subprocess.TimeoutExpired):  # before: A left after ~2.5 s (its barrier's CONFIRM)
            a.wait(timeout=8)
        (tmp_path / "go-B").touch()
        assert b.wait(timeout=60) == 0, log_b.read_text(errors="replace")[-3000:]
        assert a.wait(timeout=30) == 0, log_a.read_text(errors="replace")[-3000:]
        assert not [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "exit_barrier"]
    finally:
        _cleanup(a, *([b] if b is not None else []))


# --run-path workers: each writes <dir>/done<rank> (its pid) and its script ends; rank 1's process then lingers
# (a non-daemon thread, bounded: 60 s or <dir>/release), as a worker's teardown that does not end does.
LINGERS_AFTER_RETURN = """\
    import os, sys, threading, time
    d = sys.argv[1]
    if os.environ["RANK"] == "1":
        def linger():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not os.path.exists(os.path.join(d, "release")):
                time.sleep(0.05)
        threading.Thread(target=linger).start()
    with open(os.path.join(d, "done" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
"""


@pytest.mark.timeout(120)
def test_sigterm_while_the_agent_waits_for_returned_workers_to_exit(tmp_path: Path) -> None:
    """Before: agent54 deferred every stop signal that arrived inside ``ProcessContext.join`` (the launcher's hook, to
    keep a failure's close whole), but torch also calls that join, unbounded, once every function worker returned,
    until their processes exit. A worker whose process lingered after its script ended (a non-daemon thread, a
    teardown that hangs) made the agent ignore SIGTERM until it exited (60 s here; forever for a hung one), silently.
    Now only a failure's close defers the signal: the agent stops the workers and exits 143 at once."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(LINGERS_AFTER_RETURN))
    run_dir = tmp_path / "run"
    agent, log, tmp = _agent(tmp_path, "A", "--nproc-per-node", "2", "--run-path", "--run-dir", str(run_dir),
                             str(train), str(tmp_path))
    try:
        done = [tmp_path / "done0", tmp_path / "done1"]
        _wait_for(lambda: all(p.exists() and p.read_text() for p in done), 90, "both scripts ended", agent, log)
        _wait_for(lambda: not psutil.pid_exists(int(done[0].read_text())) or _zombie(int(done[0].read_text())),
                  30, "rank 0's process to exit", agent, log)
        agent.send_signal(signal.SIGTERM)
        try:
            rc = agent.wait(timeout=20)  # before: 60 s (rank 1's linger), then 143
        finally:
            (tmp_path / "release").touch()
        assert rc == 128 + signal.SIGTERM, (rc, log.read_text(errors="replace")[-3000:])
        assert [e["signal"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "agent_exit"] == ["SIGTERM"]
    finally:
        (tmp_path / "release").touch()
        _cleanup(agent)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_exit_barrier_keeps_torchs_own_when_its_barrier_key_is_gone(monkeypatch) -> None:
    """Before: ``exitbarrier.install`` checked only ``store_util._barrier_nonblocking``; with a torch whose agent
    module lacks ``_TERMINAL_STATE_SYNC_ID`` (renamed), its barrier replaced torch's and raised ``ImportError`` out of
    ``_exit_barrier`` after the workers succeeded (read, not seen: this torch has the key; the agent would fail a
    finished job). Now torch's barrier stays."""
    from torch.distributed.elastic.agent.server import api

    from trainguard.elastic import exitbarrier

    monkeypatch.setattr(api.SimpleElasticAgent, "_exit_barrier", api.SimpleElasticAgent._exit_barrier)
    orig = api.SimpleElasticAgent._exit_barrier
    if getattr(orig, "_tg_barrier", False):
        pytest.skip("trainguard's barrier already installed in this process")
    monkeypatch.delattr(api, "_TERMINAL_STATE_SYNC_ID")
    exitbarrier.install(events=None)
    assert api.SimpleElasticAgent._exit_barrier is orig
