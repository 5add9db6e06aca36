"""Elastic world size: agents with `--nnodes 1:2`, c10d on 127.0.0.1 and a store that outlives
them. A drill kills one agent and its worker; the survivor re-rendezvouses at world size 1,
resumes from the last checkpoint with resharded state and goes on; in the second test a new
agent then joins and the job scales back to 2. Data coverage is exact: the steps of the final
trajectory consumed a prefix of the epoch's order, each sample once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import trainguard as tg
from trainguard import layout
from trainguard.demo.model import SIZES, GPTConfig, TinyGPT, Windows, stdlib_corpus
from trainguard.events import read_events
from trainguard.report import summarize
from trainguard.sampler import ResumableSampler

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__import__("trainguard.demo.train").demo.train.__file__)),
                     "train.py")
BATCH = SIZES["tiny"][4]


def _agent(port: int, rdzv_id: str, run_dir, rec, *extra: str, fault: str | None = None) -> subprocess.Popen:
    # last_call_timeout=5: two agents started together under load still form the first round together.
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", rdzv_id, "--rdzv-conf", "is_host=false,last_call_timeout=5", "--start-method", "fork", "--run-path",
           "--run-dir", str(run_dir)]
    cmd += ["--fault", fault] if fault else []
    cmd += [TRAIN, "--steps", "30", "--save-every", "5", "--size", "tiny", "--record", str(rec), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(agents: list[subprocess.Popen], timeout: float) -> tuple[list[int], str]:
    try:
        outs = [a.communicate(timeout=timeout)[0].decode(errors="replace") for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    return [a.returncode for a in agents], "\n=====\n".join(o[-2500:] for o in outs)


def _final_trajectory(path):
    """step -> records of the attempt that last ran it (attempts run one after another)."""
    by_step: dict[int, list[dict]] = {}
    for line in open(path):
        rec = json.loads(line)
        group = by_step.setdefault(rec["step"], [])
        if group and group[-1]["world"] != rec["world"] or any(g["rank"] == rec["rank"] for g in group):
            group.clear()  # a later attempt rewrites this step
        group.append(rec)
    return by_step


def _check_coverage(traj: dict[int, list[dict]]) -> list[int]:
    """Each step ran on all ranks of its world; together they read a prefix of epoch 0's order."""
    assert sorted(traj) == list(range(1, 31))
    assert all(sorted(r["rank"] for r in g) == list(range(g[0]["world"])) for g in traj.values())
    seen = [i for s in sorted(traj) for r in traj[s] for i in r["idx"]]
    n = len(Windows(stdlib_corpus(2_000_000), GPTConfig.named("tiny").context))
    order = ResumableSampler(n, seed=0).order(0)
    assert len(seen) == len(set(seen)) == BATCH * sum(g[0]["world"] for g in traj.values())
    assert sorted(seen) == sorted(order[: len(seen)])
    return seen


@pytest.mark.timeout(240)
def test_agent_loss_scales_down_and_coverage_is_exact(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_dir, rec, job = tmp_path / "run", tmp_path / "record.jsonl", uuid.uuid4().hex
    agents = [_agent(store.port, job, run_dir, rec, fault="step=12,rank=1,kind=agent") for _ in range(2)]
    codes, out = _finish(agents, 200)
    assert sorted(codes) == [-9, 0], out
    events = list(read_events(run_dir))
    worlds = [e["world_size"] for e in events if e["event"] == "rendezvous"]
    assert 2 in worlds and worlds[-1] == 1, worlds
    restores = [e["step"] for e in events if e["event"] == "restore" and e["rank"] == 0]
    r = restores[-1]  # 10; 5 when step 10's async save was still in flight as the agent died
    assert r in (5, 10), restores
    traj = _final_trajectory(rec)
    assert {g[0]["world"] for s, g in traj.items() if s > r} == {1}
    assert len(_check_coverage(traj)) == r * 2 * BATCH + (30 - r) * BATCH


@pytest.mark.timeout(300)
def test_world_size_2_1_2_completes_with_exact_coverage(tmp_path):
    """2 agents; one is lost at step 12 (restore 10, W=1; or 5 when the async save of step 10
    was still in flight when the agent died: tiny steps on a loaded machine); at step 20 the W=1 worker commits its
    checkpoint and holds (bounded) until the test has started a third agent, whose arrival makes
    the survivor restart the group at W=2 (restore 20); the job finishes at step 30."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_dir, rec, job = tmp_path / "run", tmp_path / "record.jsonl", uuid.uuid4().hex
    hold = ("--hold-at", "20", "--hold-world", "1", "--hold-s", "50")
    agents = [_agent(store.port, job, run_dir, rec, *hold, fault="step=12,rank=1,kind=agent") for _ in range(2)]
    try:
        deadline = time.monotonic() + 150
        while not any(e["event"] == "hold" for e in read_events(run_dir)):
            assert time.monotonic() < deadline and all(a.poll() in (None, -9) for a in agents), "no hold event"
            time.sleep(0.2)
        agents.append(_agent(store.port, job, run_dir, rec, *hold))  # scale back up
    finally:
        codes, out = _finish(agents, 200)
    assert sorted(codes) == [-9, 0, 0], out
    events = list(read_events(run_dir))
    worlds = [e["world_size"] for e in events if e["event"] == "rendezvous"]
    assert worlds[:2] == [2, 2] and 1 in worlds and worlds[-2:] == [2, 2], worlds
    summary = summarize(events)
    assert summary["membership_restarts"] >= 1 and summary["failures"] == 1 and summary["final_step"] == 30
    r = summary["recoveries"][0]["restored_step"]
    assert r in (5, 10), summary["recoveries"]
    # The W=1 worker saved at 20 before holding; on the agent's SIGTERM (membership restart)
    # the manager (handle_signals) may commit a preemption save at 21 before it exits.
    held = next(e["pid"] for e in events if e["event"] == "hold")
    last_w1 = max(e["step"] for e in events if e["event"] == "save" and e["pid"] == held)
    assert last_w1 in (20, 21)
    restores = [e for e in events if e["event"] == "restore" and e["rank"] == 0]
    assert [e["step"] for e in restores] == [r, last_w1]
    traj = _final_trajectory(rec)
    phases = [g[0]["world"] for _, g in sorted(traj.items())]
    assert phases == [2] * r + [1] * (last_w1 - r) + [2] * (30 - last_w1), phases
    seen = _check_coverage(traj)
    # The final state is what the event log implies: the last 'step' event of each step gives the
    # world size that ran it, hence the global samples consumed.
    world_of = {e["step"]: e["world_size"] for e in events if e["event"] == "step"}
    assert sorted(world_of) == list(range(1, 31))
    implied = BATCH * sum(world_of.values())
    assert implied == len(seen) == BATCH * (60 - (last_w1 - r))
    state = {"model": TinyGPT(GPTConfig.named("tiny")), "data": ResumableSampler(len(seen) + 10**5, seed=0),
             "progress": tg.StateDict(step=0)}
    state["data"].num_samples = len(Windows(stdlib_corpus(2_000_000), GPTConfig.named("tiny").context))
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    tg.load(os.path.join(run_dir, layout.step_dir(30)), state, only=["model", "data", "progress"])
    assert state["progress"]["step"] == 30 and state["data"].position == implied and state["data"].epoch == 0
    assert any(not torch.equal(before[k], v) for k, v in state["model"].state_dict().items())
