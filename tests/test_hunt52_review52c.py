"""Session-52 review (review52c) of run52's failed/interrupted saves in ``trainguard report``.

Real ``trainguard run`` jobs (2 gloo ranks on 127.0.0.1, a crash point) and hand-made logs as
``EventLog`` writes them. Every child is bounded by a timeout and killed by its pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard import report as rep
from trainguard.commands.report import report as report_cmd


def _line(t: float, event: str, rank: int, pid: int, **fields: object) -> str:
    return json.dumps({"t": t, "event": event, "rank": rank, "pid": pid, **fields}) + "\n"


def _save(t: float, pid: int, step: int) -> str:
    return _line(t, "save", 0, pid, step=step, stall_s=0.01, duration_s=0.01, stall_call_s=0.01, stall_hook_s=0.0,
                 stall_wait_s=0.0, stall_prev_s=0.0, bytes=4000, async_save=False, committed_t=t)


def _log(run: Path) -> None:
    """pid 100 saves 2, begins 4, is killed after the commit of 4 (before its save event); the agent's
    restarts are used up: nothing restores 4."""
    t = 1_760_000_000.0
    lines = [_line(t, "agent_start", -1, 7, job_id="j"), _line(t + 0.5, "fresh_start", 0, 100, skipped=0)]
    lines += [_line(t + s, "step", 0, 100, step=s, world_size=2) for s in range(1, 5)]
    lines += [_line(t + 2.1, "save_start", 0, 100, step=2, async_save=False), _save(t + 2.2, 100, 2)]
    lines += [_line(t + 4.1, "save_start", 0, 100, step=4, async_save=False)]
    lines += [_line(t + 5, "failure", 0, 7, cause="exit code 17"), _line(t + 5.1, "agent_exit", -1, 7, ok=False)]
    run.mkdir(parents=True, exist_ok=True)
    (run / "events.jsonl").write_text("".join(lines))


@pytest.mark.parametrize("committed", [True, False])
def test_an_interrupted_save_whose_checkpoint_committed_is_a_save(tmp_path: Path, committed: bool) -> None:
    """The save of 4 was killed after its commit and nothing restored it: ``step-000000004/manifest.json``
    is in the run directory. ``trainguard report`` said "1 interrupted (step 4: begun, then its process ended
    before the save committed or failed)" and 1 save, with 2 checkpoints on disk; now 2 saves (1 with no save
    event) and no interrupted one. Without the checkpoint on disk (or only its temp directory) it stays interrupted."""
    run = tmp_path / "run"
    _log(run)
    (run / "step-000000002").mkdir()
    (run / "step-000000002" / "manifest.json").write_text("{}")
    if committed:
        (run / "step-000000004").mkdir()
        (run / "step-000000004" / "manifest.json").write_text("{}")
    else:
        (run / "step-000000004.tmp-0123456789abcdef").mkdir()
    res = CliRunner().invoke(report_cmd, [str(run), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert (s["saves"], s["saves_unlogged"], s["saves_interrupted"]) == ((2, 1, 0) if committed else (1, 0, 1)), s
    text = CliRunner().invoke(report_cmd, [str(run)]).output
    assert ("failed saves" in text) == (not committed), text
    assert rep.summary(rep.tally_log(run))["saves_interrupted"] == 1  # events alone: no directory to look in


WORKER = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(8), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(2), keep=tg.KeepLatest(10),
                              async_save=os.environ.get("W_ASYNC") == "1") as mgr:
        step = mgr.restore(state) or 0
        while step < 6:
            step += 1
            t = torch.ones(1)
            dist.all_reduce(t)
            state["progress"]["step"] = step
            mgr.save(step, state)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("async_save", ["0", "1"])
def test_a_job_killed_at_its_last_commit_reports_the_save(tmp_path: Path, async_save: str) -> None:
    """A real job: rank 0 exits at ``after_rename`` of its second save (step 4, committed) and
    ``--max-restarts 0`` ends the job. The report counted 1 save and step 4 "interrupted ... before the save
    committed" while ``step-000000004`` was committed on disk; now its saves are the checkpoints on disk."""
    run, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text(WORKER)
    env = {**os.environ, "TMPDIR": str(tmp_path), "TRAINGUARD_CRASH_AT": "after_rename", "TRAINGUARD_CRASH_RANK": "0",
           "TRAINGUARD_CRASH_SKIP": "1", "W_ASYNC": async_save}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--run-dir", str(run), str(script)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, out[-3000:]
    on_disk = sorted(d.name for d in run.glob("step-*") if (d / "manifest.json").is_file())
    assert on_disk == ["step-000000002", "step-000000004"], (on_disk, out[-3000:])
    res = CliRunner().invoke(report_cmd, [str(run), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert (s["saves"], s["saves_interrupted"], s["saves_failed"]) == (2, 0, 0), s


def test_a_requeue_with_the_same_pid_on_another_host_is_no_clock_step(tmp_path: Path) -> None:
    """Two jobs of 10 steps an hour apart in one run directory, each in a fresh container (agent pid 1, rank 0
    pid 40 both times), the second on a host whose monotonic clock is 5,000,000 s (~58 days) ahead. The report
    compared the two jobs' pid-40 steps by ``mono`` as one process's and reported a wall time of 4,999,010 s;
    it is 3,610.5 s (the hour between the jobs included, as for any two jobs of a log)."""
    t1, t2, lines = 1_760_000_000.0, 1_760_003_600.0, []
    for t, base, steps in ((t1, 1_000.0, range(1, 11)), (t2, 5_000_000.0, range(11, 21))):
        lines.append(_line(t, "agent_start", -1, 1, job_id="j", mono=base))
        lines.append(_line(t + 0.2, "rendezvous", -1, 1, world_size=1, nodes=1, node_rank=0, seconds=0.2, mono=base + 0.2))
        lines += [_line(t + i + 1, "step", 0, 40, step=s, world_size=1, mono=base + i + 1) for i, s in enumerate(steps)]
        lines.append(_line(t + 10.5, "agent_exit", -1, 1, ok=True, mono=base + 10.5))
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = rep.summary(rep.tally_log(tmp_path))
    assert s["wall_s"] == pytest.approx(3610.5) and s["final_step"] == 20, s
    assert s == rep.summarize(rep.load(tmp_path))
    # The clock set back 3,600 s between two steps of one process of the second job is still measured by mono.
    lines[-2] = _line(t2 + 10 - 3600, "step", 0, 40, step=20, world_size=1, mono=5_000_010.0)
    lines[-1] = _line(t2 + 10.5 - 3600, "agent_exit", -1, 1, ok=True, mono=5_000_010.5)
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = rep.summary(rep.tally_log(tmp_path))
    assert s["wall_s"] == pytest.approx(3610.5) and s["final_step"] == 20, s


def _three_attempts(offsets: list[tuple[float, float]]) -> tuple[str, float]:
    """A log of one agent (pid 1, ``mono``) and 3 attempts of 10 steps of a second (rank 0: pids 100-102, each with
    its own ``mono``), 2 failures with restarts of 4 s; the wall clock's offset becomes ``o`` at true second ``at``
    for each ``(at, o)``. Returns the log and the true seconds from ``agent_start`` to ``agent_exit``."""
    tau, step, out = 0.0, 0, []

    def line(event: str, rank: int, pid: int, mono: float, **fields: object) -> None:
        off = ([o for at, o in offsets if tau >= at] or [0.0])[-1]
        out.append(_line(1_760_000_000.0 + tau + off, event, rank, pid, mono=round(mono, 6), **fields))

    line("agent_start", -1, 1, 5000 + tau, job_id="j")
    for a in range(3):
        tau += 0.2
        line("rendezvous", -1, 1, 5000 + tau, world_size=1, nodes=1, node_rank=0, seconds=0.2)
        tau += 1.0
        for _ in range(10):
            tau += 1.0
            step += 1
            line("step", 0, 100 + a, 100.0 * (a + 1) + tau, step=step, world_size=1)
        if a < 2:
            tau += 0.5
            line("restart", -1, 1, 5000 + tau, remaining_restarts=3, reason="failure")
            tau += 4.0
    tau += 0.5
    line("agent_exit", -1, 1, 5000 + tau, ok=True)
    return "".join(out), tau


@pytest.mark.parametrize(("forward", "later"), [(3600.0, 0.0), (1000.0, -2600.0)])
def test_a_clock_set_forward_in_a_later_restart_takes_back_the_step_back(tmp_path: Path, forward: float,
                                                                         later: float) -> None:
    """The clock is set back 3,600 s during the first restart and forward ``forward`` s during the second. The
    agent's ``mono`` measured both; the report counted the step back (and the first restart's seconds) but not the
    step forward: a wall time of 3,643 s (1,043 s) for a job of 43, as if the clock had never come forward. Two steps
    of one process already take a step forward from a step back (``tally.Tally.step``); now two agent events
    around a restart do too (``clockback.AgentBridge``), where the restart's step pair is the only one between them."""
    text, truth = _three_attempts([(13.0, -3600.0), (29.5, later)])
    (tmp_path / "events.jsonl").write_text(text)
    s = rep.summary(rep.tally_log(tmp_path))
    assert s["wall_s"] == pytest.approx(truth, abs=0.01) and s["final_step"] == 30, (s["wall_s"], truth)
    assert s == rep.summarize(rep.load(tmp_path))
    # A step forward alone during a restart is wall time, as one between two steps of a process is (as before).
    text, truth = _three_attempts([(13.0, 1000.0)])
    (tmp_path / "events.jsonl").write_text(text)
    assert rep.summary(rep.tally_log(tmp_path))["wall_s"] == pytest.approx(truth + 1000, abs=0.01)


@pytest.mark.parametrize("pid2", [1, 2])
def test_a_save_cut_short_in_a_container_run_again_with_the_same_pid_is_interrupted(tmp_path: Path, pid2: int) -> None:
    """``python train.py`` as pid 1 of a container (no agent): killed while it saved step 10, run again (pid 1 again),
    restores 5 and saves 12. The save of 10 was reported only when the second process had another pid: its
    ``restore`` ended the open saves of every pid but its own. Its ``manager_open`` (a manager's close waits for its
    saves, and one manager holds a root) now ends them all: 1 interrupted save with either pid."""
    t, t2 = 1_760_000_000.0, 1_760_000_100.0
    lines = [_line(t, "manager_open", 0, 1, world_size=1, async_save=False), _line(t + 0.1, "fresh_start", 0, 1, skipped=0)]
    lines += [_line(t + s, "step", 0, 1, step=s, world_size=1) for s in range(1, 11)]
    lines += [_line(t + 5.1, "save_start", 0, 1, step=5, async_save=False), _save(t + 5.2, 1, 5)]
    lines += [_line(t + 10.1, "save_start", 0, 1, step=10, async_save=False)]
    lines += [_line(t2, "manager_open", 0, pid2, world_size=1, async_save=False),
              _line(t2 + 0.1, "restore", 0, pid2, step=5, seconds=0.1)]
    lines += [_line(t2 + s - 5, "step", 0, pid2, step=s, world_size=1) for s in range(6, 13)]
    lines += [_line(t2 + 7.1, "save_start", 0, pid2, step=12, async_save=False), _save(t2 + 7.2, pid2, 12)]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = rep.summary(rep.tally_log(tmp_path))
    assert (s["saves"], s["saves_interrupted"]) == (2, 1), s
    assert [(x["step"], x["how"]) for x in s["failed_saves"]] == [(10, "interrupted")], s
    assert s == rep.summarize(rep.load(tmp_path))


@pytest.mark.parametrize("offsets", [[(6.3, 1000.0), (9.3, 0.0)], [(6.3, 1000.0), (13.0, 0.0)],
                                     [(6.3, 1000.0), (20.3, 500.0)]], ids=["in-one-process", "back-in-a-restart",
                                                                          "back-half-later"])
def test_a_clock_set_forward_then_back_reports_the_last_step_and_the_true_wall_time(tmp_path: Path,
                                                                                     offsets: list[tuple[float, float]]) -> None:
    """The clock is set forward 1,000 s during the first attempt and back 1,000 s (or 500 s, in the second attempt)
    later: the steps' ``mono`` (and the agent's) measured both. The net set-back was not above 0, so the report took
    the final step and the end from the greatest ``t``, those of the time the clock was ahead: ``final step 8`` (10,
    13) of 30 and a wall time of 1,009 s (1,012 s, 1,020 s) for 43. Now the log's last step and its last ``t``
    less the net step: 30 and 43 s."""
    text, truth = _three_attempts(offsets)
    (tmp_path / "events.jsonl").write_text(text)
    s = rep.summary(rep.tally_log(tmp_path))
    assert s["final_step"] == 30 and s["wall_s"] == pytest.approx(truth, abs=0.01), (s["final_step"], s["wall_s"], truth)
    assert s == rep.summarize(rep.load(tmp_path))
