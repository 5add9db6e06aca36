"""Session-44 elastic hunt: real ``trainguard run`` jobs (c10d on 127.0.0.1, gloo, forked
``--run-path`` workers) with workers killed at chosen points, checked through the event log
and ``trainguard report``.

Every process is bounded (a timeout on each wait) and killed by its pid at the end of its test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from test_elastic_scale import _finish  # agents waited for, killed past the timeout
from trainguard.events import read_events
from trainguard.report import format_summary, summarize

CLI = [sys.executable, "-c", "from trainguard.cli import main; main()", "run"]

# Saves every 5 steps (sync), 10 steps. argv: a marker file; while it does not exist, the
# worker's first read of a checkpoint's bytes (its restore after a failure) SIGKILLs it.
WORKER = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed as dist
    import trainguard as tg
    import trainguard.loader as loader

    torch.set_num_threads(1)
    mark, read = sys.argv[1], loader.read_targets

    def read_targets(*a, **k):  # the restore after a failure reads bytes: killed there, once
        if mark != "-":
            try:
                os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return read(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        return read(*a, **k)

    loader.read_targets = read_targets
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(5), async_save=False) as mgr:
        step = mgr.restore(state) or 0
        while step < 10:
            net(torch.ones(1, 2)).sum().backward()
            opt.step()
            step += 1
            state["progress"]["step"] = step
            mgr.save(step, state)
    if world > 1:
        dist.destroy_process_group()
""")


def _run(args: list[str], timeout: float) -> tuple[int, str]:
    p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=timeout)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out.decode(errors="replace")[-4000:]




@pytest.mark.timeout(120)
def test_a_restart_killed_in_its_restore_does_not_count_the_lost_steps_twice(tmp_path: Path) -> None:
    """Rank 0 is killed at step 7 (checkpoint 5: steps 6 and 7 lost); the restarted worker is
    SIGKILLed in its restore; the next one restores 5 and finishes. `trainguard report` said
    "lost steps 4": both failures took the one first step after them, and its 2 lost steps,
    as their own."""
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(WORKER)
    code, out = _run(["--nproc-per-node", "1", "--max-restarts", "3", "--start-method", "fork", "--run-path",
                      "--run-dir", str(run_dir), "--fault", "step=7,rank=0,kind=kill", str(script),
                      str(tmp_path / "killed-in-restore")], 100)
    assert code == 0, out
    assert (tmp_path / "killed-in-restore").exists(), out
    summary = summarize(read_events(run_dir))
    assert summary["failures"] == 2 and summary["final_step"] == 10, summary
    assert summary["steps_run"] == 12, summary  # 1..7, then 6..10
    assert [r["restored_step"] for r in summary["recoveries"]] == [5, 5], summary
    assert summary["lost_steps"] == 2, summary  # was 4
    assert [r["lost_steps"] for r in summary["recoveries"]] == [2, 0], summary
    assert "lost steps 2\n" in format_summary(summary) + "\n"


@pytest.mark.timeout(150)
def test_the_other_agents_restart_after_a_worker_failure_is_no_joining_agent(tmp_path: Path) -> None:
    """Two agents of one worker each; rank 1 is killed at step 7. Its agent logs the failure and
    re-rendezvouses; the other agent sees it waiting and restarts its worker for "membership"
    (or, when its worker's collective failed first, logs a failure of its own). The report said
    "1 restarts for joining agents" and "lost steps 4 (2 at restarts for joining agents)": no
    agent joined, and 2 steps were lost."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(WORKER)
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{store.port}", "--rdzv-id", "hunt44", "--rdzv-conf", "is_host=false,last_call_timeout=3",
            "--max-restarts", "3", "--start-method", "fork", "--run-path", "--run-dir", str(run_dir),
            "--fault", "step=7,rank=1,kind=kill", str(script), "-"]
    agents = [subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    codes, out = _finish(agents, 130)
    assert codes == [0, 0], out
    events = list(read_events(run_dir))
    assert [e["step"] for e in events if e["event"] == "restore" and e["rank"] == 0] == [5], out
    summary = summarize(events)
    assert summary["final_step"] == 10 and summary["steps_run"] == 12, summary
    assert summary["membership_restarts"] == 0, summary  # was 1
    assert summary["lost_steps"] == 2 and summary["membership_lost_steps"] == 0, summary  # was 4 and 2
    assert "(0 restarts for joining agents)" in format_summary(summary)


# World size 1: commits step 3, then holds (bounded) until the agent's SIGTERM (an agent joined);
# the step in progress then takes 3 s (a long training step), and save(4) commits the preemption
# save. World size 2: restores and trains to step 6.
HELD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import trainguard as tg

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model = torch.nn.Linear(2, 2)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(3), async_save=False) as mgr:
        step = mgr.restore(state) or 0
        while step < 6 and not mgr.should_stop:
            net(torch.ones(1, 2)).sum().backward()
            opt.step()
            step += 1
            state["progress"]["step"] = step
            if step == 4 and world == 1:
                time.sleep(3)  # the step the stop signal came in: longer than --stop-timeout
            mgr.save(step, state)
            if step == 3 and world == 1:
                Path(sys.argv[1]).touch()
                deadline = time.monotonic() + 60
                while not mgr._preempt.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
    if world > 1:
        dist.destroy_process_group()
""")


@pytest.mark.timeout(150)
def test_a_membership_restart_waits_for_the_preemption_save_of_a_step_longer_than_the_stop_timeout(
        tmp_path: Path) -> None:
    """An agent joins a world-size-1 job whose steps take longer than --stop-timeout (1 s here,
    5 s by default). The worker answers the agent's SIGTERM by finishing its step (3 s) and
    committing a preemption save of step 4. Before, the agent SIGKILLed it --stop-timeout after
    the SIGTERM, mid-step: nothing was saved and the group at world size 2 restored step 3."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script, run_dir, held = tmp_path / "train.py", tmp_path / "run", tmp_path / "held"
    script.write_text(HELD)
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{store.port}", "--rdzv-id", "hunt44held", "--rdzv-conf", "is_host=false,last_call_timeout=3",
            "--stop-timeout", "1", "--start-method", "fork", "--run-path", "--run-dir", str(run_dir), str(script),
            str(held)]
    agents = [subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    try:
        deadline = time.monotonic() + 90
        while not held.exists():
            assert time.monotonic() < deadline and agents[0].poll() is None, "the worker never held"
            time.sleep(0.05)
        agents.append(subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    finally:
        codes, out = _finish(agents, 120)
    assert codes == [0, 0], out
    events = list(read_events(run_dir))
    assert [e["reason"] for e in events if e["event"] == "restart"] == ["membership"], out
    assert [e["step"] for e in events if e["event"] == "save" and e["rank"] == 0] == [3, 4, 6], out  # 4: was missing
    assert [e["step"] for e in events if e["event"] == "restore" and e["rank"] == 0] == [4], out  # was 3


@pytest.mark.timeout(120)
def test_steps_lost_when_the_whole_job_died_and_was_started_again_are_reported(tmp_path: Path) -> None:
    """A one-node job loses its agent at step 7 (the drill kills the agent, then the worker: every
    process of the job); it is started again with the same --rdzv-id, restores step 5 and finishes.
    Its first step logged 2 lost steps, but no failure or restart event led to it, and `trainguard
    report` said "failures 0, lost steps 0" (a requeue after a node failure read as lossless)."""
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(WORKER)
    args = ["--nproc-per-node", "1", "--rdzv-id", "hunt44requeue", "--start-method", "fork", "--run-path",
            "--run-dir", str(run_dir), "--fault", "step=7,rank=0,kind=agent", str(script), "-"]
    code, out = _run(args, 50)
    assert code == -9, out  # the agent was SIGKILLed
    code, out = _run(args, 50)  # the requeue: the drill fired once for this job already
    assert code == 0, out
    summary = summarize(read_events(run_dir))
    assert summary["failures"] == 0 and summary["final_step"] == 10 and summary["steps_run"] == 12, summary
    assert summary["lost_steps"] == 2 and summary["resubmit_lost_steps"] == 2, summary  # was 0
    assert "lost steps 2 (2 at starts of the whole job again)" in format_summary(summary)
