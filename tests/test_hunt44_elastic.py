"""Session-44 elastic hunt: real ``trainguard run`` jobs (c10d on 127.0.0.1, gloo, forked
``--run-path`` workers) with workers killed at chosen points, checked through the event log
and ``trainguard report``.

Every process is bounded (a timeout on each wait) and killed by its pid at the end of its test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

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


def _finish(agents: list[subprocess.Popen], timeout: float) -> tuple[list[int], str]:
    try:
        outs = [a.communicate(timeout=timeout)[0].decode(errors="replace") for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    return [a.returncode for a in agents], "\n=====\n".join(o[-3000:] for o in outs)


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
