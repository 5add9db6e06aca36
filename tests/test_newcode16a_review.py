"""Review of the new code in ranks, the manager and ``trainguard run`` (newcode16a): what a
late Ctrl-C, a rank's exit and the agent's signals left open. Bounded in time; gloo on 127.0.0.1."""

from __future__ import annotations

import json
import threading

import torch

import trainguard as tg
import trainguard.async_save as asv


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def _ctrl_c_after_the_save_thread_started(monkeypatch) -> None:  # noqa: ANN001
    real = threading.Thread.start

    def start_then_ctrl_c(self) -> None:  # noqa: ANN001
        real(self)
        if self.name == "trainguard-async-save":
            monkeypatch.setattr(threading.Thread, "start", real)
            asv._INFLIGHT.go.set()  # as start_async_save does once start() returned: the thread may begin
            while asv._INFLIGHT is not None and asv._INFLIGHT.began is False:  # until its thread owns the save
                threading.Event().wait(0.001)
            raise KeyboardInterrupt  # after start(), before the call returns

    monkeypatch.setattr(threading.Thread, "start", start_then_ctrl_c)


def test_a_managed_async_save_whose_call_a_late_ctrl_c_ended_is_still_the_managers(tmp_path, monkeypatch):
    # Before: the save thread committed step 1 but the manager never recorded it (no pending
    # handle): no 'save' event, last_saved_step None, step 1 not its own; a notebook re-running
    # the loop from step 1 then saved step 1 again, that save failed (StepExistsError) and the
    # next save(2) raised it: the run stopped.
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    assert mgr.restore(_state(0)) is None
    _ctrl_c_after_the_save_thread_started(monkeypatch)
    try:
        mgr.save(1, _state(1))
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:
        pass
    mgr.wait()  # the save the Ctrl-C left running
    assert mgr.last_saved_step == 1 and 1 in mgr._own
    assert mgr.save(1, _state(1)) is None  # the loop re-run from step 1: saved already
    assert mgr.save(2, _state(2)) is not None
    mgr.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in events if e["event"] == "save"] == [("save", 1), ("save", 2)]
    assert [e["step"] for e in events if e["event"] == "save_start"] == [1, 2]  # the re-run's save(1) began none
    assert tg.CheckpointManager(tmp_path).latest_step() == 2


# The agent: trainguard run's main, with an at-fork hook that sends it SIGTERM while it forks its
# worker (once torch's agent handler is installed): the handler's SignalException is raised inside
# the hook, where Python ignores it ("Exception ignored in: <function hook>").
AGENT = """\
    import os, signal, sys
    fired = []

    def hook():
        h = signal.getsignal(signal.SIGTERM)
        if not fired and getattr(h, "__name__", "") == "handler":  # the agent's handler (install_signal_once)
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the hook
                pass

    os.register_at_fork(after_in_parent=hook)
    from trainguard.elastic.launcher import main
    sys.exit(main(sys.argv[1:]))
"""

WORKER = """\
    import os, sys, time
    import torch
    import trainguard as tg

    out = sys.argv[1]
    mgr = tg.CheckpointManager(os.path.join(out, "ck"), save=tg.EveryNSteps(10**6))
    state, t0, step = {"w": torch.zeros(4)}, time.monotonic(), 0
    with mgr:
        while time.monotonic() - t0 < 20:  # bounded: the run a lost SIGTERM lets go on
            step += 1
            mgr.save(step, state)
            if mgr.should_stop:
                break
            time.sleep(0.01)
    open(os.path.join(out, "stopped" if mgr.should_stop else "finished"), "w").write(str(step))
    sys.exit(mgr.exit_code)
"""


def test_a_sigterm_the_agent_got_while_forking_a_worker_still_stops_the_job(tmp_path):
    import subprocess
    import sys
    import textwrap

    from test_elastic16_review import _env, _wait_all

    # Before: the agent's SignalException was swallowed in fork's at-fork hook; the agent and its
    # worker trained on (the worker ran its whole loop, 'finished', agent exit 0): a scheduler's
    # SIGTERM then SIGKILL lost everything since the last save. Now the agent's next monitor round
    # raises it again: the worker gets SIGTERM, saves, and the agent exits 143.
    (tmp_path / "agent.py").write_text(textwrap.dedent(AGENT))
    (tmp_path / "train.py").write_text(textwrap.dedent(WORKER))
    log = tmp_path / "log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            [sys.executable, str(tmp_path / "agent.py"), "--nproc-per-node", "1", "--start-method", "fork",
             "--run-path", "--run-dir", str(tmp_path / "run"), str(tmp_path / "train.py"), str(tmp_path)],
            stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
        )
        codes = _wait_all([p], [log], timeout=60)
    text = log.read_text(errors="replace")
    assert "Exception ignored" in text, text[-3000:]  # the hook did swallow the first raise
    assert codes == [143], text[-3000:]
    assert (tmp_path / "stopped").exists() and not (tmp_path / "finished").exists(), text[-3000:]


# Rank 1 returns at once (torch's worker wrapper then sleeps in the "workers finished" event's
# wait()); rank 0 fails once rank 1 has returned.
RETURNS_THEN_PEER_FAILS = """\
    import os, sys, time
    out, rank = sys.argv[1], int(os.environ["RANK"])
    if rank == 1:
        open(os.path.join(out, "returned"), "w").write("1")
        sys.exit(0)
    for _ in range(1000):  # bounded: 10 s
        if os.path.exists(os.path.join(out, "returned")):
            break
        time.sleep(0.01)
    time.sleep(0.5)  # rank 1 is asleep in the event's wait() by now
    sys.exit(1)
"""


def test_the_agent_ends_when_a_worker_fails_after_another_returned(tmp_path):
    import subprocess
    import sys
    import textwrap

    from test_elastic16_review import _env, _wait_all

    # Before: torch's join SIGTERMed rank 1 while it slept in the finished event's wait() (with
    # fork, since 3c23de1 its inherited handler ends it by SIG_DFL; with spawn always), then the
    # agent's _close hook called finished.set(), which waits for every sleeper to wake
    # (multiprocessing.Condition.notify): the dead one never did and the agent hung for good.
    (tmp_path / "w.py").write_text(textwrap.dedent(RETURNS_THEN_PEER_FAILS))
    log = tmp_path / "log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; from trainguard.elastic.launcher import main; sys.exit(main(sys.argv[1:]))",
             "--nproc-per-node", "2", "--max-restarts", "0", "--run-path", "--start-method", "fork",
             "--run-dir", str(tmp_path / "run"), str(tmp_path / "w.py"), str(tmp_path)],
            stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
        )
        codes = _wait_all([p], [log], timeout=100)  # the agent's and workers' start included (a hang: killed)
    assert codes == [1], log.read_text(errors="replace")[-3000:]
    assert '"failure"' in (tmp_path / "run" / "events.jsonl").read_text()


def _managed_ctrl_c_on_rank_1(rank: int, world: int, root: str) -> dict:
    import pytest

    from test_rejoin import _state as big_state

    mp = pytest.MonkeyPatch()
    out: dict = {}
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False, timeout=20).open()
    mgr.restore(big_state(0))
    if rank == 1:
        _ctrl_c_after_the_save_thread_started(mp)
    try:
        mgr.save(1, big_state(1))
        out["first"] = None
    except KeyboardInterrupt:
        out["first"] = "KeyboardInterrupt"
    mp.undo()
    out["rest"] = []
    for s in (1, 2, 3):  # the loop goes on from the step it was at
        try:
            mgr.save(s, big_state(s))
            out["rest"].append(None)
        except Exception as e:  # noqa: BLE001 - compared by the test
            out["rest"].append(f"{type(e).__name__}: {e}"[:300])
    mgr.close()
    out["last"] = mgr.last_saved_step
    return out


def test_two_ranks_agree_after_a_late_ctrl_c_on_one_ranks_managed_async_save(tmp_path):
    from test_rejoin import ENV

    from dist_helper import run_ranks

    # Before: rank 1's manager did not know step 1 was saved and saved it again while rank 0
    # skipped it: the ranks' calls no longer paired; save(2) failed on rank 1 and save(3) on rank 0
    # ("rank(s) [0] left this trainguard call before 'begin'"), steps 2 and 3 were never saved.
    res = run_ranks(_managed_ctrl_c_on_rank_1, 2, str(tmp_path), timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert [v["first"] for v in vals] == [None, "KeyboardInterrupt"], vals
    assert [v["rest"] for v in vals] == [[None] * 3] * 2, vals
    assert [v["last"] for v in vals] == [3, 3], vals
    assert tg.CheckpointManager(tmp_path).latest_step() == 3
