"""Session-51 hunt of the event log and ``trainguard report`` under failures (events51).

Real processes killed at a save's commit (``TRAINGUARD_CRASH_AT``), real ``trainguard run`` jobs
(2 gloo ranks on 127.0.0.1), and logs written by trainguard's own ``EventLog`` with its clock set
back. Every child is bounded by a timeout and killed by its pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard import events as events_mod
from trainguard import report as rep
from trainguard.cli import main
from trainguard.events import EventLog, read_events

# argv: run dir, last step, sync|async. Saves every step (steps 1..last), keeps them all.
TRAIN = textwrap.dedent("""
    import os, sys
    import torch
    import trainguard as tg
    torch.set_num_threads(1)
    root, last, asyn = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "async"
    state = {"w": torch.zeros(64), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(100), async_save=asyn) as mgr:
        step = mgr.restore(state) or 0
        while step < last:
            step += 1
            state["w"].add_(1)
            mgr.save(step, state)
""")


def _child(forked, args: list[str], env: dict[str, str | None], log: Path) -> int:
    """TRAIN in a process of its own, forked by ``conftest.forked`` (torch imported once); 0 or -9 (SIGKILL)."""
    code = forked(TRAIN, *args, env=env, log=log)
    if code not in (0, -9):
        raise AssertionError(log.read_text(errors="replace")[-3000:])
    return code


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if "tmp" not in p.name)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_killed_at_its_commit_is_counted_from_its_restore(tmp_path: Path, forked, mode: str) -> None:
    """A process SIGKILLed right after its save of step 2 committed (``after_rename``: the checkpoint
    is there, its ``save`` event is not); the next process restores step 2 and saves step 3. Three
    checkpoints on disk, three saves; the report said 2 saves."""
    root = tmp_path / "run"
    env: dict[str, str | None] = {"TRAINGUARD_CRASH_AT": "after_rename", "TRAINGUARD_CRASH_KIND": "kill",
                                  "TRAINGUARD_CRASH_SKIP": "1"}
    assert _child(forked, [str(root), "5", mode], env, tmp_path / "killed.log") == -9  # killed at step 2's commit
    env = {k: None for k in [*os.environ, *env] if k.startswith("TRAINGUARD_CRASH")}
    assert _child(forked, [str(root), "3", mode], env, tmp_path / "resumed.log") == 0
    assert _steps_on_disk(root) == [1, 2, 3]
    events = list(read_events(root))
    assert [e["step"] for e in events if e["event"] == "save"] == [1, 3]  # step 2's process was killed first
    assert [e["step"] for e in events if e["event"] == "restore"] == [2]
    s = rep.summary(rep.tally_log(root))
    assert s["saves"] == 3 and s["saves_unlogged"] == 1, s  # was 2
    assert s["save_stall_mean_s"] == pytest.approx(s["save_stall_s"] / 2)  # of the two saves whose stall is logged
    res = CliRunner().invoke(main, ["report", str(root)])
    assert res.exit_code == 0, res.output
    assert "3 saves (1 with no save event, known from its restore" in res.output
    assert rep.summarize(events)["saves"] == 3


def test_a_restored_step_whose_save_is_logged_is_not_counted_again(tmp_path: Path) -> None:
    """Restores of logged saves (twice: a restart killed in its restore) add nothing."""
    log = EventLog(tmp_path / "events.jsonl", rank=0)
    for s in (1, 2):
        log.emit("save", step=s, stall_s=0.5, duration_s=1.0, bytes=10, committed_t=0.0)
    log.emit("restore", step=2, seconds=0.1)
    log.emit("restore", step=2, seconds=0.1)
    s = rep.summary(rep.tally_log(tmp_path))
    assert s["saves"] == 2 and s["saves_unlogged"] == 0 and s["save_stall_mean_s"] == 0.5


class _Clock:
    now = 1_760_000_000.0

    def time(self) -> float:
        return self.now


def _clock_set_back_log(path: Path, monkeypatch: pytest.MonkeyPatch, *, steps: int, back: float) -> None:
    """A job's log, written by EventLog on a clock (a step a second, a save every 100 steps on 2 ranks)
    that an NTP step sets back by ``back`` seconds halfway."""
    clock = _Clock()
    monkeypatch.setattr(events_mod, "time", clock)
    agent, r0, r1 = (EventLog(path, rank=r) for r in (-1, 0, 1))
    agent.emit("agent_start", job_id="j")
    agent.emit("rendezvous", world_size=2, nodes=1, node_rank=0, seconds=1.0)
    for s in range(1, steps + 1):
        clock.now += 1.0
        if s == steps // 2:
            clock.now -= back
        r0.emit("step", step=s, world_size=2)
        if s % 100 == 0:
            for log in (r0, r1):
                log.emit("save", step=s, stall_s=0.1, duration_s=1.0, stall_call_s=0.1, stall_hook_s=0.0, stall_wait_s=0.0,
                         stall_prev_s=0.0, bytes=1000, async_save=True, committed_t=round(clock.now, 6))
    clock.now += 1.0
    agent.emit("agent_exit", ok=True)
    monkeypatch.undo()


@pytest.mark.parametrize("back", [100.0, 8000.0])  # within the report's window of 4,096 steps, and past it (read twice)
def test_a_clock_set_back_keeps_the_final_step_and_the_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 back: float) -> None:
    """10,000 steps of a second, the clock set back halfway. The report said: final step 4999 and wall
    time 4999 s (set back 8,000 s), wall time 9901 s (set back 100 s); the run ran 10,000 steps in
    10,001 s. Counts stay those of the log, read twice or not (no event counted twice)."""
    _clock_set_back_log(tmp_path / "events.jsonl", monkeypatch, steps=10_000, back=back)
    res = CliRunner().invoke(main, ["report", "--json", str(tmp_path)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["final_step"] == 10_000, s
    assert 10_000 - 1 <= s["wall_s"] <= 10_001 + 1, s  # the step back is seen one step late: 1 s less
    assert s["steps_run"] == 10_000 and s["saves"] == 100 and s["events"] == 10_203, s
    assert s["save_stall_s"] == pytest.approx(10.0) and s["step_s"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(1.0, abs=0.01)


def test_a_log_in_time_order_reports_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No clock set back: the last step by time, the last t; summarize of the list is the report."""
    _clock_set_back_log(tmp_path / "events.jsonl", monkeypatch, steps=300, back=0.0)
    s = rep.summary(rep.tally_log(tmp_path))
    assert s == rep.summarize(list(read_events(tmp_path)))
    assert s["final_step"] == 300 and s["wall_s"] == pytest.approx(301.0) and s["saves"] == 3


WORKER = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":  # the restarted workers are not killed again
        os.environ.pop("TRAINGUARD_CRASH_AT", None)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(5), keep=tg.KeepLatest(100),
                              async_save=sys.argv[1] == "async") as mgr:
        step = mgr.restore(state) or 0
        while step < 20:
            net(torch.ones(1, 16)).sum().backward()
            opt.step()
            step += 1
            state["progress"]["step"] = step
            mgr.save(step, state)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_trainguard_run_of_2_ranks_killed_at_a_commit_reports_every_checkpoint(tmp_path: Path) -> None:
    """`trainguard run`, 2 gloo ranks, async saves every 5 steps; rank 0 SIGKILLed right after the
    commit of step 10 (its second pass of ``after_rename``, the first skipped). The agent restarts
    both, they restore 10 and finish at 20: 4 checkpoints on disk, 4 saves (was 3)."""
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(WORKER)
    env = {**os.environ, "TRAINGUARD_CRASH_AT": "after_rename", "TRAINGUARD_CRASH_RANK": "0",
           "TRAINGUARD_CRASH_KIND": "kill", "TRAINGUARD_CRASH_SKIP": "1"}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--start-method", "fork", "--run-path", "--log-dir", str(tmp_path / "logs"), "--run-dir", str(run_dir),
           str(script), "async"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=150)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out[-4000:]
    assert _steps_on_disk(run_dir) == [5, 10, 15, 20]
    s = rep.summary(rep.tally_log(run_dir))
    assert s["failures"] == 1 and [r["restored_step"] for r in s["recoveries"]] == [10], s
    assert s["saves"] == 4 and s["saves_unlogged"] == 1 and s["final_step"] == 20, s
    (r,) = s["recoveries"]  # no fault event (a crash): recover runs from when the agent saw it, = its three parts
    assert r.get("detect_s") is None and r["recover_s"] == pytest.approx(r["restart_s"] + r["restore_s"] + r["first_step_s"])


def _jl(t: float, event: str, who: int, pid: int, **fields: object) -> str:
    """A line as EventLog writes it: ``rank`` ``who`` (-1: the agent's; its ``failure`` names the failed rank)."""
    return json.dumps({"t": t, "event": event, "rank": who, "pid": pid, **fields}) + "\n"


def _restart_log(back: float) -> str:
    """Rank 0 (pid 100) trains steps 1-20, saved at 10, and is killed; the agent logs the failure; the
    clock is set back by ``back`` s during the restart; pid 200 restores 10 and trains 11-30."""
    t0, lines = 1_760_000_000.0, []
    lines.append(_jl(t0, "agent_start", -1, 7, job_id="j"))
    lines.append(_jl(t0 + 0.5, "first_step", 0, 100, step=1, world_size=1, lost_steps=0))
    for s in range(1, 21):
        lines.append(_jl(t0 + s, "step", 0, 100, step=s, world_size=1))
        if s == 10:
            lines.append(_jl(t0 + s + 0.1, "save", 0, 100, step=10, stall_s=0.1, duration_s=0.2, bytes=1, committed_t=t0 + s))
    lines.append(_jl(t0 + 21, "failure", 0, 7, cause="killed by SIGKILL"))  # the agent's: rank is the failed rank
    t = t0 + 21 - back
    lines.append(_jl(t + 2, "restore", 0, 200, step=10, seconds=0.5))
    lines.append(_jl(t + 3, "first_step", 0, 200, step=11, world_size=1, lost_steps=10))
    lines += [_jl(t + 3 + i, "step", 0, 200, step=11 + i, world_size=1) for i in range(20)]
    lines.append(_jl(t + 23, "agent_exit", -1, 7, ok=True))
    return "".join(lines)


@pytest.mark.parametrize("back", [0.0, 3600.0])
def test_a_clock_set_back_during_a_restart_keeps_its_recovery(tmp_path: Path, back: float) -> None:
    """Set back 3,600 s between the agent's failure and the new worker's restore, the report said:
    `final step 20`, wall time 21 s, `restored step None, lost None`, and the 10 lost steps counted as
    lost `at starts of the whole job again`. The restore is paired with the failure logged before it;
    durations across the step back are unknown (`-`), not -3,597 s."""
    (tmp_path / "events.jsonl").write_text(_restart_log(back))
    s = rep.summary(rep.tally_log(tmp_path))
    assert s == rep.summarize(list(read_events(tmp_path)))
    assert s["final_step"] == 30 and s["failures"] == 1 and s["lost_steps"] == 10 and s["resubmit_lost_steps"] == 0, s
    (r,) = s["recoveries"]
    assert r["restored_step"] == 10 and r["lost_steps"] == 10 and r["restore_s"] == 0.5 and r["first_step_s"] == 1.0, r
    if back:
        assert r["restart_s"] is None and r["recover_s"] is None, r
        assert 40.0 <= s["wall_s"] <= 44.0, s  # 44 s ran; the 3 s of the restart across the step back are not seen
    else:
        assert r["restart_s"] == pytest.approx(1.5) and r["recover_s"] == pytest.approx(3.0) and s["wall_s"] == 44.0, s
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "restored step 10, lost 10" in res.output and "starts of the whole job" not in res.output


STUCK = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    state = {"w": torch.zeros(8), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(2), async_save=False) as mgr:
        step = mgr.restore(state) or 0
        while step < 6:
            step += 1
            state["progress"]["step"] = step
            if step == 3 and first and dist.get_rank() == 0:
                t = time.monotonic()  # busy elsewhere (a long write): it does not see rank 1 die; the agent stops it
                while time.monotonic() - t < 60:
                    time.sleep(0.05)
            mgr.save(step, state)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_the_time_the_agent_spends_stopping_the_other_workers_is_restart_not_detect(tmp_path: Path) -> None:
    """Rank 1 is killed at step 3 (``--fault``) while rank 0 is busy and does not notice: the agent sees
    the death at its next poll, then stops rank 0 (1 s grace, SIGTERM, 1 s, SIGKILL) and only then logs
    the ``failure``. The report timed "detect" from the fault to that event: the stop, which the docs
    count in "restart", was in "detect" (detect 2.19 s, restart 0.61 s for an async save in flight; here
    likewise). The event now says how long the stop took (``stop_s``), and detect ends where the agent saw it."""
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(STUCK)
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2", "--start-method",
           "fork", "--run-path", "--log-dir", str(tmp_path / "logs"), "--run-dir", str(run_dir),
           "--fault", "step=3,rank=1,kind=kill", str(script)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=150)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out[-4000:]
    events = list(read_events(run_dir))
    (fault,) = [e for e in events if e["event"] == "fault"]
    (failure,) = [e for e in events if e["event"] == "failure"]
    (restore,) = [e for e in events if e["event"] == "restore" and e["rank"] == 0]
    assert failure["stop_s"] >= 1.0, failure  # the agent's grace before its SIGTERM to rank 0, at least
    s = rep.summary(rep.tally_log(run_dir))
    (r,) = s["recoveries"]
    seen = failure["t"] - failure["stop_s"]
    assert r["detect_s"] == pytest.approx(seen - fault["t"], abs=1e-6), (r, failure, fault)
    assert r["restart_s"] == pytest.approx(restore["t"] - restore["seconds"] - seen, abs=1e-6), (r, failure)
    assert r["restart_s"] >= failure["stop_s"]  # the stop is part of the restart
    parts = r["detect_s"] + r["restart_s"] + r["restore_s"] + r["first_step_s"]
    assert parts == pytest.approx(r["recover_s"], abs=1e-6) and r["restored_step"] == 2, r


class _TwoClocks(_Clock):
    """A wall clock and a monotonic one (``time.monotonic``), which an NTP step does not move."""

    mono = 500.0

    def monotonic(self) -> float:
        return self.mono


@pytest.mark.parametrize("forward", [True, False])
def test_a_clock_set_back_and_forward_again_keeps_the_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                forward: bool) -> None:
    """Session 51: 200 steps of a second logged by rank 0's heartbeat (the watchdog's ``step`` events, which
    carry ``mono``), the clock set back 3,600 s at step 100 and (``forward``) forward again at step 150. The
    set-back was added to the wall time while the step forward looked like a pause: 3,799 s reported for a run
    of 200 s (11df3cc, before the set-back was counted: 200 s). Read by the report's fast path and by
    ``summarize`` of the parsed events."""
    from trainguard.elastic import watchdog as wd
    from trainguard.elastic.faults import EVENTS_FILE

    clock = _TwoClocks()
    monkeypatch.setattr(events_mod, "time", clock)
    monkeypatch.setattr(wd, "time", clock)
    for k, v in {"TRAINGUARD_RUN_DIR": str(tmp_path), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)  # what a worker of `trainguard run` has
    for k in ("TRAINGUARD_FAULT", "TRAINGUARD_WATCHDOG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(wd, "_HEART", None)  # built again from this environment at the first heartbeat
    path = tmp_path / EVENTS_FILE
    agent = EventLog(path, rank=-1)
    agent.emit("agent_start", job_id="j")
    for s in range(1, 201):
        clock.now += 1.0
        clock.mono += 1.0
        if s == 100:
            clock.now -= 3600.0
        if s == 150 and forward:
            clock.now += 3600.0
        wd.heartbeat(s)  # rank 0's heartbeat: a first_step event, then a step event each call
    clock.now += 1.0
    agent.emit("agent_exit", ok=True)
    monkeypatch.undo()
    assert '"mono": ' in path.read_text().splitlines()[-2]
    s = rep.summary(rep.tally_log(tmp_path))
    assert s == rep.summarize(list(read_events(tmp_path)))
    assert s["final_step"] == 200 and 199 <= s["wall_s"] <= 201, s
    assert s["goodput"] == pytest.approx(1.0, abs=0.02), s
