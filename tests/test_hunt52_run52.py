"""Session-52 hunt of ``trainguard run`` and ``trainguard report`` (run52).

Real ``trainguard run`` jobs (2 gloo ranks on 127.0.0.1, a fault drill), their temp directory private to
the test (``TMPDIR``); logs written as ``EventLog`` writes them. Every child is bounded by a timeout and
killed by its pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard import report as rep
from trainguard.events import read_events

# A worker: 2 gloo ranks, an all-reduce a step (a peer's death fails it), a sync save every 2 steps.
WORKER = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(8), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(2), async_save=False) as mgr:
        step = mgr.restore(state) or 0
        while step < 6:
            step += 1
            t = torch.ones(1)
            dist.all_reduce(t)
            state["w"].add_(t)
            state["progress"]["step"] = step
            mgr.save(step, state)
    dist.destroy_process_group()
""")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> tuple[int, str]:
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["run-path", "script"])
def test_a_failed_worker_leaves_no_error_file_in_the_temp_directory(tmp_path: Path, workers: str) -> None:
    """Rank 1 raises at step 3 (``--fault kind=exception``), rank 0 then fails in its all-reduce; the agent
    restarts both, which finish. Before, torch left in ``TMPDIR`` one ``pytorch-errorfile-*.pickle`` (~2 KB)
    per raising function worker (``--run-path``: 2 here) and, without ``--log-dir``, a ``torchelastic_*``
    directory (both kinds of worker). Now nothing is left there, and the worker's traceback still reaches
    the agent's output (``--run-path``: that of rank 1, which raised first, not only rank 0's gloo error;
    before, rank 1 was named "exit code 1" alone). The agent's log directory (``trainguard-logs-*``) is gone
    at its exit; nothing of it is in the run directory."""
    tmp, run_dir, script = tmp_path / "tmp", tmp_path / "run", tmp_path / "train.py"
    tmp.mkdir()
    script.write_text(WORKER)
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--run-dir", str(run_dir), "--fault", "step=3,rank=1,kind=exception"]
    cmd += ["--start-method", "fork", "--run-path", str(script)] if workers == "run-path" else [str(script)]
    rc, out = _run(cmd, env)
    assert rc == 0, out[-4000:]
    events = list(read_events(run_dir))
    assert [e["rank"] for e in events if e["event"] == "failure"] == [1], events
    assert max(e["step"] for e in events if e["event"] == "step") == 6
    assert all(isinstance(e.get("mono"), float) for e in events if e["rank"] == -1), events  # clockback.py
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("pytorch-errorfile-", "torchelastic_", "trainguard-logs-")))
    assert left == [], left
    assert "InjectedFault: injected fault: step=3,rank=1,kind=exception" in out, out[-4000:]  # the agent logged it
    assert not (run_dir / ".trainguard" / "logs").exists()


def test_a_given_log_dir_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--log-dir`` given: torch's agent uses it, as before (the default applies only without one)."""
    from trainguard.elastic import errfiles
    from trainguard.elastic.launcher import build_parser, prepare

    # prepare() writes the agent's environment: TRAINGUARD_WATCHDOG=1 and TRAINGUARD_AGENT_PID=<this pytest
    # worker> stayed in the xdist worker, and a later test's _Heart() started watchdog threads that probed
    # this process (os.kill(pid, 0)) every 0.2 s for good (test_fault_agent42 saw their kills, CI).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for given, want in ((["--log-dir", str(tmp_path / "mine")], str(tmp_path / "mine")),
                        (["--redirects", "3"], None), (["--tee", "1"], None)):  # the workers' output: torch's own, kept
        args = build_parser().parse_args(["--run-dir", str(tmp_path / "run"), *given, "train.py"])
        prepare(args)
        assert args.log_dir == want, given
    args = build_parser().parse_args(["--run-dir", str(tmp_path / "run"), "train.py"])
    prepare(args)
    assert os.path.basename(args.log_dir).startswith(errfiles.LOG_PREFIX) and os.path.isdir(args.log_dir)
    os.rmdir(args.log_dir)  # the agent's exit removes it (atexit); this process is pytest's


def _raise_in_order(index: int, stop_file: str) -> None:
    """Process 1 raises first; process 0 raises once process 1 noted its raise (a peer failing in its
    collective after the cause): both write torch's error file and exit 1."""
    import glob
    import time

    from trainguard.elastic import stops

    if index == 0:
        end = time.monotonic() + 30
        while not glob.glob(f"{stop_file}.raised-*") and time.monotonic() < end:  # bounded
            time.sleep(0.01)
    stops.note_raised()
    raise RuntimeError("rank 1's own error" if index else "Connection closed by peer")


@pytest.mark.timeout(120)
def test_the_first_to_raise_is_reported_with_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both function workers raise, rank 1 first; torch's ``join`` reports rank 0 (first in process order) with
    its traceback, the agent's hook names rank 1 (``root_failure``). It said "process 1 terminated with exit
    code 1" without rank 1's traceback, which torch had in rank 1's error file: the agent's output showed rank 0's
    consequence and not the cause. The error files are removed once the context is done (``errfiles.drop``)."""
    import multiprocessing.connection
    import tempfile

    import torch.multiprocessing as tmp
    from torch.multiprocessing.spawn import ProcessException, ProcessRaisedException

    from trainguard.elastic import errfiles, stops

    stop_file = str(tmp_path / "stopped")
    monkeypatch.setenv(stops.STOP_FILE_ENV, stop_file)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # torch names the error files there
    pc = tmp.start_processes(_raise_in_order, args=(stop_file,), nprocs=2, join=False, start_method="fork")
    try:
        pending = [p.sentinel for p in pc.processes]
        while pending:  # both gone before anyone looks; bounded
            ready = multiprocessing.connection.wait(pending, timeout=30)
            assert ready, "workers did not exit"
            pending = [s for s in pending if s not in ready]
        with pytest.raises(ProcessException) as raised:
            pc.join(1)
        assert raised.value.error_index == 0 and "Connection closed by peer" in str(raised.value)
        cause = stops.root_failure(pc, raised.value)
        assert isinstance(cause, ProcessRaisedException) and cause.error_index == 1, cause
        assert "RuntimeError: rank 1's own error" in str(cause), str(cause)
        assert sorted(p.name for p in tmp_path.glob("pytorch-errorfile-*")) != []
        errfiles.drop(pc)
        assert list(tmp_path.glob("pytorch-errorfile-*")) == []
    finally:
        for p in pc.processes:
            p.join(5)


# A worker saving every 5 steps (sync or async); the crash drill of the first attempt only.
SAVER = textwrap.dedent("""
    import os, sys
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        os.environ.pop("TRAINGUARD_CRASH_AT", None)  # the drill fires in the first attempt only
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(1 << 12), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(5), keep=tg.KeepLatest(100),
                              async_save=sys.argv[1] == "async") as mgr:
        step = mgr.restore(state) or 0
        while step < 15:
            t = torch.ones(1)
            dist.all_reduce(t)
            step += 1
            state["progress"]["step"] = step
            mgr.save(step, state)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_a_save_cut_short_by_the_agent_is_reported_as_interrupted(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed in its save of step 10 (``TRAINGUARD_CRASH_AT=written``); rank 0 waits in that save for
    its report, and the agent SIGKILLs it 2 s later, before it logs ``save_failed``. The report said `3 saves`
    and nothing of the save of step 10 (no event but the next start's ``debris``); it now says it was
    interrupted (rank 0's ``save_start`` with no end), in ``report --json`` too."""
    from click.testing import CliRunner

    from trainguard.cli import main

    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SAVER)
    env = {**os.environ, "TMPDIR": str(tmp_path), "TRAINGUARD_CRASH_AT": "written", "TRAINGUARD_CRASH_RANK": "1",
           "TRAINGUARD_CRASH_KIND": "kill", "TRAINGUARD_CRASH_SKIP": "1"}
    rc, out = _run([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2",
                    "--start-method", "fork", "--run-path", "--run-dir", str(run_dir), str(script), "sync"], env)
    assert rc == 0, out[-4000:]
    s = rep.summary(rep.tally_log(run_dir))
    assert s == rep.summarize(list(read_events(run_dir)))  # the fast path and the parsed events agree
    assert s["failures"] == 1 and s["saves"] == 3 and [r["restored_step"] for r in s["recoveries"]] == [5], s
    assert (s["saves_failed"], s["saves_interrupted"]) == (0, 1), s
    assert [(x["step"], x["how"]) for x in s["failed_saves"]] == [(10, "interrupted")], s
    res = CliRunner().invoke(main, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert "failed saves       1: 1 interrupted (step 10: " in res.output, res.output
    res = CliRunner().invoke(main, ["report", "--json", str(run_dir)])
    assert json.loads(res.output)["saves_interrupted"] == 1, res.output


def _line(t: float, event: str, rank: int, pid: int, **fields: object) -> str:
    return json.dumps({"t": t, "event": event, "rank": rank, "pid": pid, **fields}) + "\n"


def _save(t: float, pid: int, step: int) -> str:
    """A ``save`` line as ``saveevent.emit`` writes it (read by ``eventscan``'s fast path)."""
    return _line(t, "save", 0, pid, step=step, stall_s=0.1, duration_s=0.2, stall_call_s=0.1, stall_hook_s=0.0,
                 stall_wait_s=0.0, stall_prev_s=0.0, bytes=10, async_save=False, committed_t=t)


def _job(starts: bool) -> str:
    """pid 100 saves 5, begins 10 and is killed (the agent's failure); pid 200 restores 5, saves 10, begins 15 and
    fails it with an error, saves 20, begins 25 (still in flight when the log ends). ``starts``: rank 0 logs its
    save starts (since session 52)."""
    t, out = 1_760_000_000.0, []

    def start(t: float, pid: int, step: int) -> None:
        if starts:
            out.append(_line(t, "save_start", 0, pid, step=step, async_save=False))

    out.append(_line(t, "agent_start", -1, 7, job_id="j"))
    out.append(_line(t + 0.5, "fresh_start", 0, 100, skipped=0))
    out.append(_line(t + 0.6, "first_step", 0, 100, step=1, world_size=2, lost_steps=0))
    for s in range(1, 11):
        out.append(_line(t + s, "step", 0, 100, step=s, world_size=2))
        if s in (5, 10):
            start(t + s + 0.01, 100, s)
        if s == 5:
            out.append(_save(t + s + 0.2, 100, 5))
    out.append(_line(t + 13, "failure", 1, 7, cause="killed by SIGKILL", stop_s=2.0))
    out.append(_line(t + 13.1, "restart", -1, 7, remaining_restarts=2, reason="failure"))
    out.append(_line(t + 14, "restore", 0, 200, step=5, seconds=0.1))
    out.append(_line(t + 14.2, "first_step", 0, 200, step=6, world_size=2, lost_steps=5))
    for s in range(6, 26):
        out.append(_line(t + 9 + s, "step", 0, 200, step=s, world_size=2))
        if s in (10, 15, 20, 25):
            start(t + 9 + s + 0.01, 200, s)
        if s in (10, 20):
            out.append(_save(t + 9 + s + 0.2, 200, s))
        if s == 15:
            out.append(_line(t + 9 + s + 0.2, "save_failed", 0, 200, step=15, error="no space left on device\nmore"))
            out.append(_line(t + 9 + s + 0.2, "save_failed", 1, 201, step=15, error="no space left on device"))
    return "".join(out)


@pytest.mark.parametrize("starts", [True, False])
def test_failed_and_interrupted_saves_of_a_log(tmp_path: Path, starts: bool) -> None:
    """The save of step 10 begun and never ended by its killed process is interrupted; rank 0's ``save_failed``
    of 15 is a failed save (rank 1's is not counted again); 25, in flight when the log ends, is neither. A log
    without ``save_start`` events (written before them) reports its failed saves and no interrupted ones
    (unknown: null); its other figures are the same either way (but for the times the extra lines add)."""
    (tmp_path / "events.jsonl").write_text(_job(starts))
    s = rep.summary(rep.tally_log(tmp_path))
    assert s == rep.summarize(list(read_events(tmp_path)))
    assert s["saves"] == 3 and s["failures"] == 1 and s["final_step"] == 25, s
    assert s["saves_failed"] == 1 and s["saves_interrupted"] == (1 if starts else None), s
    want = [(10, "interrupted"), (15, "failed")] if starts else [(15, "failed")]
    assert [(x["step"], x["how"]) for x in s["failed_saves"]] == want, s
    text = rep.format_summary(s)
    line = next(x for x in text.splitlines() if x.startswith("failed saves"))
    assert "1 failed (step 15; the first: no space left on device)" in line, line
    assert ("1 interrupted (step 10: " in line) == starts, line
    (tmp_path / "events.jsonl").write_text(_job(not starts))
    other = rep.summary(rep.tally_log(tmp_path))
    same = ("final_step", "steps_run", "failures", "recoveries", "lost_steps", "saves", "saves_unlogged", "save_stall_s",
            "saves_failed")
    assert {k: s[k] for k in same} == {k: other[k] for k in same}


def test_a_log_with_no_failed_save_reports_as_before(tmp_path: Path) -> None:
    """Without a failed or interrupted save the text has no new line, and ``--json`` has its fields as before
    plus the three new ones: 0, null (no save_start: a log from before them) and []."""
    lines = [_line(1_760_000_000.0, "agent_start", -1, 7, job_id="j")]
    lines += [_line(1_760_000_000.0 + s, "step", 0, 100, step=s, world_size=1) for s in range(1, 11)]
    lines.append(_save(1_760_000_010.5, 100, 10))
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = rep.summary(rep.tally_log(tmp_path))
    assert (s["saves"], s["saves_failed"], s["saves_interrupted"], s["failed_saves"]) == (1, 0, None, []), s
    assert "failed saves" not in rep.format_summary(s)
    # after every field it had (review56l's "problems" after them: problems.py)
    assert list(s)[-4:] == ["saves_failed", "saves_interrupted", "failed_saves", "problems"]


def test_a_save_that_committed_is_not_interrupted(tmp_path: Path) -> None:
    """pid 100 begins the save of 10 and is killed right after its commit (no ``save`` event; pid 200 restores
    10: a save, ``saves_unlogged``); pid 300 (another node's rank 0 in a shared log) logs its save of 20 after
    the agent's failure: ended, not interrupted."""
    t = 1_760_000_000.0
    lines = [_line(t, "agent_start", -1, 7, job_id="j"), _line(t + 0.5, "fresh_start", 0, 100, skipped=0)]
    lines += [_line(t + s, "step", 0, 100, step=s, world_size=1) for s in range(1, 11)]
    lines += [_line(t + 5.1, "save_start", 0, 100, step=5), _save(t + 5.2, 100, 5)]
    lines += [_line(t + 10.1, "save_start", 0, 100, step=10), _line(t + 12, "failure", 0, 7, cause="killed by SIGKILL")]
    lines += [_line(t + 13, "restore", 0, 200, step=10, seconds=0.1)]
    lines += [_line(t + 13 + s, "step", 0, 200, step=10 + s, world_size=1) for s in range(1, 11)]
    lines += [_line(t + 23.1, "save_start", 0, 200, step=20), _line(t + 23.5, "failure", 1, 8, cause="exit code 1"),
              _save(t + 23.6, 200, 20), _line(t + 24, "agent_exit", -1, 7, ok=True)]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = rep.summary(rep.tally_log(tmp_path))
    assert (s["saves"], s["saves_unlogged"], s["saves_interrupted"], s["failed_saves"]) == (3, 1, 0, []), s


def _set_back_log(back: float, *, agent_mono: bool, later: float = 0.0, nodes: int = 1, requeue: bool = False) -> str:
    """True time T from t0, every process on one host (one monotonic clock, ``mono`` = 500 + T): the agent starts
    (T=0), pid 100 trains steps 1-20 (T=1..20), the agent logs the failure (21) and restart (21.1); the wall clock
    is set back by ``back`` s at T=21.5; the agent's rendezvous (22), pid 200 restores step 10 (23) and trains
    11-30 (T=24..43), the clock set back ``later`` s more at T=33.5 (between two of its steps); agent_exit (44).
    ``agent_mono``: the agent's events carry ``mono`` (since session 52); the steps carry theirs. ``nodes``: of the
    rendezvous. ``requeue``: the job is started again on another host (T=50), by an agent of the same pid (7, as in
    containers) whose monotonic clock is 10^6 s ahead and wall clock 100 s behind; it trains steps 31-35 (T=52..56)
    and exits (57)."""
    t0, lines = 1_760_000_000.0, []

    def at(T: float) -> float:  # the requeue's host: its wall clock 100 s behind
        return t0 + T - (back if T >= 21.5 else 0.0) - (later if T >= 33.5 else 0.0) - (100.0 if T >= 50 else 0.0)

    def agent(T: float, event: str, **fields: object) -> None:
        lines.append(_line(at(T), event, -1, 7, **fields, **({"mono": 500 + T} if agent_mono else {})))

    agent(0, "agent_start", job_id="j")
    lines.append(_line(at(0.5), "first_step", 0, 100, step=1, world_size=1, lost_steps=0))
    for s in range(1, 21):
        lines.append(_line(at(s), "step", 0, 100, step=s, world_size=1, mono=500.0 + s))
    agent(21, "failure", cause="killed by SIGKILL", stop_s=0.0)
    agent(21.1, "restart", remaining_restarts=2, reason="failure")
    agent(22, "rendezvous", world_size=1, nodes=nodes, node_rank=0, seconds=0.5)
    lines.append(_line(at(23), "restore", 0, 200, step=10, seconds=0.5))
    lines.append(_line(at(24), "first_step", 0, 200, step=11, world_size=1, lost_steps=10))
    for i in range(20):
        lines.append(_line(at(24 + i), "step", 0, 200, step=11 + i, world_size=1, mono=524.0 + i))
    agent(44, "agent_exit", ok=True)
    if requeue:
        lines.append(_line(at(50), "agent_start", -1, 7, job_id="j", **({"mono": 1e6 + 50} if agent_mono else {})))
        lines.append(_line(at(51), "restore", 0, 300, step=30, seconds=0.5))
        lines.append(_line(at(52), "first_step", 0, 300, step=31, world_size=1, lost_steps=0))
        lines += [_line(at(52 + i), "step", 0, 300, step=31 + i, world_size=1, mono=1e6 + 52 + i) for i in range(5)]
        lines.append(_line(at(57), "agent_exit", -1, 7, ok=True, **({"mono": 1e6 + 57} if agent_mono else {})))
    return "".join(lines)


@pytest.mark.parametrize("later", [0.0, 100.0])
def test_a_clock_set_back_during_a_restart_keeps_the_restart_in_the_wall_time(tmp_path: Path, later: float) -> None:
    """The clock set back 3,600 s during a restart: the steps' drop of ``t`` across the restart (new processes)
    counted 3,596 s back, and the wall time missed the restart's 4 s (40 s reported for 44; session 51's test
    says so). The agent's events now carry ``mono``: its failure/restart and rendezvous straddle the step back and
    measure it exactly, 44 s. ``later``: a second step back within pid 200's steps (measured by their own
    ``mono``) is not counted twice. Without the agent's ``mono`` (a log from before) the report is as before."""
    for agent_mono, want in ((True, 44.0), (False, 40.0)):
        (tmp_path / "events.jsonl").write_text(_set_back_log(3600.0, agent_mono=agent_mono, later=later))
        s = rep.summary(rep.tally_log(tmp_path))
        assert s == rep.summarize(list(read_events(tmp_path)))
        assert s["wall_s"] == pytest.approx(want), (agent_mono, s)
        assert s["final_step"] == 30 and s["failures"] == 1 and s["lost_steps"] == 10, s
    (tmp_path / "events.jsonl").write_text(_set_back_log(0.0, agent_mono=True))  # no step back: as before
    assert rep.summary(rep.tally_log(tmp_path))["wall_s"] == pytest.approx(44.0)
    # Agents of several nodes (a pid and a monotonic clock per host): the estimate stands, as before.
    (tmp_path / "events.jsonl").write_text(_set_back_log(3600.0, agent_mono=True, nodes=2))
    assert rep.summary(rep.tally_log(tmp_path))["wall_s"] == pytest.approx(40.0)
    # A later agent of the same pid on another host: not paired with the first one's events (its agent_start); the
    # requeue's step back of its host's clock is estimated as before, the restart's 4 s still added.
    walls = []
    for agent_mono in (True, False):
        (tmp_path / "events.jsonl").write_text(_set_back_log(3600.0, agent_mono=agent_mono, requeue=True))
        s = rep.summary(rep.tally_log(tmp_path))
        assert s == rep.summarize(list(read_events(tmp_path))), s
        walls.append(s["wall_s"])
    assert walls[0] == pytest.approx(walls[1] + 4.0), walls
