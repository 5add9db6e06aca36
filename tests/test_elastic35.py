"""Session-35 elastic audit: ``trainguard run`` with script workers (torch's default, the form
docs/elastic.md shows) whose DataLoader has worker processes.

A stop signal from the agent (a SIGTERM to the agent; a membership restart when an agent joins)
went to the worker's whole process group (torch's ``os.killpg``): the DataLoader's processes died
of it, the training process raised ``RuntimeError: DataLoader worker ... is killed by signal``
from its SIGCHLD handler and never reached the preemption save ``handle_signals=True`` owes the
signal. The agent still exited 143 ("they saved"), and a scale-up resumed from the last periodic
checkpoint. Now the signal spares the worker's multiprocessing children (elastic/spare.py).

Every process is bounded in time (a deadline in the worker, a timeout on each wait) and killed by
its pid at the end of its test; c10d rendezvous on 127.0.0.1, gloo."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from trainguard.events import read_events
from trainguard.report import format_summary, summarize
from trainguard.sampler import ResumableSampler

from conftest import free_port

CLI = [sys.executable, "-c", "from trainguard.cli import main; main()", "run"]
N, BATCH, STEPS, HOLD = 40, 2, 8, 3

WORKER = textwrap.dedent(f"""
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    import trainguard as tg

    torch.set_num_threads(1)
    rec, run_dir, hold_world = sys.argv[1], os.environ["TRAINGUARD_RUN_DIR"], int(sys.argv[2])
    handle, every = sys.argv[3] == "1", int(sys.argv[4])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = tg.ResumableSampler({N}, seed=0)
    loader = DataLoader(list(range({N})), batch_size={BATCH}, sampler=sampler, num_workers=1,
                        generator=torch.Generator())
    state = {{"model": model, "optim": opt, "data": sampler, "progress": tg.StateDict(step=0)}}
    with tg.CheckpointManager(run_dir, save=tg.EveryNSteps(every), handle_signals=handle) as mgr:
        step = mgr.restore(state) or 0
        for x in loader:
            net(x.float()[:, None]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sampler.advance(len(x))
            step += 1
            state["progress"]["step"] = step
            with open(rec, "a") as f:
                f.write(json.dumps({{"step": step, "rank": rank, "world": world, "idx": x.tolist()}}) + "\\n")
            mgr.save(step, state)
            if mgr.should_stop or step >= {STEPS}:
                break
            if step == {HOLD} and world == hold_world:  # the loader's process is alive; bounded hold
                Path = __import__("pathlib").Path
                Path(rec + ".held").touch()
                deadline = time.monotonic() + 60
                while not mgr._preempt.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
    sys.exit(mgr.exit_code)
""")


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        assert any(p.poll() is None for p in procs), "the agents ended first"
        time.sleep(0.05)


def _agent(run_dir: Path, script: Path, rec: Path, *rdzv: str, signals: bool = True, every: int = 100) -> subprocess.Popen:
    cmd = [*CLI, "--nproc-per-node", "1", "--rdzv-backend", "c10d", *rdzv, "--run-dir", str(run_dir),
           str(script), str(rec), "1", "1" if signals else "0", str(every)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], str]:
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], "\n=====\n".join(o[-3000:] for o in outs)


def _records(rec: Path) -> list[dict]:
    return [json.loads(line) for line in rec.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_sigterm_to_agent_saves_with_dataloader_workers(tmp_path):
    """SIGTERM to `trainguard run` while the worker's DataLoader process is alive: the worker
    commits its preemption save at the next step and the agent exits 143 (before: the loader
    process died of the group signal, the worker raised, nothing was saved, still exit 143)."""
    script, rec, run_dir = tmp_path / "train.py", tmp_path / "rec.jsonl", tmp_path / "run"
    script.write_text(WORKER)
    agent = _agent(run_dir, script, rec, "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    try:
        _wait_for(Path(f"{rec}.held"), [agent], 90)
        agent.send_signal(signal.SIGTERM)
    finally:
        codes, out = _finish([agent], 60)
    assert codes == [143], out
    assert "is killed by signal" not in out, out
    saves = [e["step"] for e in read_events(run_dir) if e["event"] == "save"]
    assert saves == [HOLD + 1], (saves, out)  # the preemption save, at the step after the hold


@pytest.mark.timeout(150)
def test_scale_up_commits_preemption_save_with_dataloader_workers(tmp_path):
    """One agent (--nnodes 1:2) trains at world size 1 with a DataLoader worker; a second agent
    joins at step 3; the first agent's membership restart SIGTERMs its worker, which saves step 4;
    the job resumes from step 4 at world size 2 and each sample is read once (before: no save,
    the W=2 group started afresh from step 0)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script, rec, run_dir = tmp_path / "train.py", tmp_path / "rec.jsonl", tmp_path / "run"
    script.write_text(WORKER)
    rdzv = ("--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "elastic35",
            "--rdzv-conf", "is_host=false,last_call_timeout=3")
    agents = [_agent(run_dir, script, rec, *rdzv)]
    try:
        _wait_for(Path(f"{rec}.held"), agents, 90)
        agents.append(_agent(run_dir, script, rec, *rdzv))
    finally:
        codes, out = _finish(agents, 100)
    assert codes == [0, 0], out
    assert "is killed by signal" not in out, out
    events = list(read_events(run_dir))
    assert [e["reason"] for e in events if e["event"] == "restart"] == ["membership"], out
    assert [e["step"] for e in events if e["event"] == "restore" and e["rank"] == 0] == [HOLD + 1], out
    recs = _records(rec)
    final = {(r["step"], r["rank"]): r for r in recs}  # the last attempt's record of each step
    assert sorted({s for s, _ in final}) == list(range(1, STEPS + 1))
    assert {final[(s, 0)]["world"] for s in range(1, HOLD + 2)} == {1}
    assert {r["world"] for (s, _), r in final.items() if s > HOLD + 1} == {2}
    seen = [i for r in final.values() for i in r["idx"]]
    assert len(seen) == len(set(seen)) == BATCH * ((HOLD + 1) + 2 * (STEPS - HOLD - 1))
    assert sorted(seen) == sorted(ResumableSampler(N, seed=0).order(0)[: len(seen)])


@pytest.mark.timeout(150)
def test_report_counts_steps_lost_at_a_restart_for_a_joining_agent(tmp_path):
    """Without a preemption save (handle_signals=False) the world-size-1 worker's step 3 is lost
    when an agent joins (restored step 2): `trainguard report` counted lost steps of failures only
    and said 0, which also hid the DataLoader bug above (the scale-up runs that lost steps read as
    lossless)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script, rec, run_dir = tmp_path / "train.py", tmp_path / "rec.jsonl", tmp_path / "run"
    script.write_text(WORKER)
    rdzv = ("--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "elastic35b",
            "--rdzv-conf", "is_host=false,last_call_timeout=3")
    agents = [_agent(run_dir, script, rec, *rdzv, signals=False, every=2)]
    try:
        _wait_for(Path(f"{rec}.held"), agents, 90)
        agents.append(_agent(run_dir, script, rec, *rdzv, signals=False, every=2))
    finally:
        codes, out = _finish(agents, 100)
    assert codes == [0, 0], out
    summary = summarize(read_events(run_dir))
    assert summary["membership_restarts"] == 1 and summary["failures"] == 0, summary
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "restore" and e["rank"] == 0] == [HOLD - 1]
    assert summary["lost_steps"] == 1, summary  # was 0
    assert summary["membership_lost_steps"] == 1, summary
    assert "lost steps 1 (1 at restarts for joining agents)" in format_summary(summary)


FAILING = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from trainguard.elastic import heartbeat

    dist.init_process_group("gloo")
    rank, release = dist.get_rank(), sys.argv[1]
    for step in range(1, 4):
        heartbeat(step)  # TRAINGUARD_FAULT: rank 1 raises InjectedFault at step 3 (exit 1)
    deadline = time.monotonic() + 60  # rank 0: no collective, so it fails only by the agent's SIGTERM
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
""")


@pytest.mark.timeout(90)
def test_failure_event_names_the_rank_that_raised_not_the_peer_the_agent_sigtermed(tmp_path):
    """Script workers: rank 1 raises (exit 1); the agent SIGTERMs rank 0. The `failure` event (and
    `trainguard report`'s recovery line) named rank 0, "killed by SIGTERM", as the cause."""
    script, run_dir = tmp_path / "fail.py", tmp_path / "run"
    script.write_text(FAILING)
    cmd = [*CLI, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--max-restarts", "0", "--fault", "step=3,rank=1,kind=exception",
           "--run-dir", str(run_dir), str(script), str(tmp_path / "never")]
    codes, out = _finish([subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)], 80)
    assert codes == [1], out
    failure = next(e for e in read_events(run_dir) if e["event"] == "failure")
    assert failure["failures"] == {"0": "killed by SIGTERM", "1": "exit code 1"}, failure
    assert (failure["rank"], failure["cause"]) == (1, "exit code 1"), failure  # was (0, "killed by SIGTERM")
