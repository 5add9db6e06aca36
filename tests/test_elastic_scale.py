"""Elastic world size: two agents (`--nnodes 1:2`, c10d on 127.0.0.1, a store that outlives
them); a drill kills one agent and its worker; the survivor re-rendezvouses at world size 1,
resumes from the last checkpoint with resharded state and finishes. Data coverage is exact:
the steps of the final trajectory consumed a prefix of the epoch's order, each sample once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch.distributed as dist

from trainguard.demo.model import SIZES, GPTConfig, Windows, stdlib_corpus
from trainguard.events import read_events
from trainguard.sampler import ResumableSampler

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__import__("trainguard.demo.train").demo.train.__file__)),
                     "train.py")


def _final_trajectory(path):
    """step -> indices of the attempt that last wrote it (attempts run one after another)."""
    by_step: dict[int, list[dict]] = {}
    for line in open(path):
        rec = json.loads(line)
        group = by_step.setdefault(rec["step"], [])
        if group and group[-1]["world"] != rec["world"] or any(g["rank"] == rec["rank"] for g in group):
            group.clear()  # a later attempt rewrites this step
        group.append(rec)
    return by_step


@pytest.mark.timeout(240)
def test_agent_loss_scales_down_and_coverage_is_exact(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_dir, rec = tmp_path / "run", tmp_path / "record.jsonl"
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
           "--rdzv-id", uuid.uuid4().hex, "--rdzv-conf", "is_host=false,last_call_timeout=5",
           "--start-method", "fork", "--run-path", "--run-dir", str(run_dir),
           "--fault", "step=12,rank=1,kind=agent", TRAIN, "--steps", "30", "--save-every", "5",
           "--size", "tiny", "--record", str(rec)]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=200)[0].decode(errors="replace") for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    codes = sorted(a.returncode for a in agents)
    assert codes == [-9, 0], "\n=====\n".join(o[-2500:] for o in outs)
    events = list(read_events(run_dir))
    worlds = [e["world_size"] for e in events if e["event"] == "rendezvous"]
    assert 2 in worlds and worlds[-1] == 1, worlds
    restores = [e["step"] for e in events if e["event"] == "restore" and e["rank"] == 0]
    assert restores[-1] == 10
    traj = _final_trajectory(rec)
    assert sorted(traj) == list(range(1, 31))
    assert {g[0]["world"] for s, g in traj.items() if s > 10} == {1}
    seen = [i for g in traj.values() for r in g for i in r["idx"]]
    n = len(Windows(stdlib_corpus(2_000_000), GPTConfig.named("tiny").context))
    order = ResumableSampler(n, seed=0).order(0)
    assert len(seen) == len(set(seen)) == 10 * 2 * SIZES["tiny"][4] + 20 * SIZES["tiny"][4]
    assert sorted(seen) == sorted(order[: len(seen)])
