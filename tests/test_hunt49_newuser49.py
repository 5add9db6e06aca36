"""Session 49, helper newuser49: a new user's GPT script (DDP, 2 DataLoader workers, async saves)
adopted from the README and docs, run under ``trainguard run`` with a kill drill and world-size
changes, then the CLI on its run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

PEER = r'''
import os, signal, sys
import torch, torch.distributed as dist
from torch.utils.data import DataLoader

dist.init_process_group("gloo")
rank = dist.get_rank()
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a CheckpointManager does (it only sets a flag)
loader = DataLoader(list(range(1000)), batch_size=4, num_workers=2)  # forked now: they hold the gloo sockets
it = iter(loader)
next(it)
dist.all_reduce(torch.ones(1))
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(torch.ones(1))  # rank 1 is dead
except RuntimeError as e:
    with open(os.path.join(sys.argv[1], "peer-error.txt"), "w") as f:
        f.write(str(e))
    raise
'''


@pytest.mark.parametrize("workers", ["run-path", "script"])
def test_a_killed_ranks_loader_processes_no_longer_keep_its_peers_blocked(tmp_path, workers):
    """A rank SIGKILLed with DataLoader processes (forked after ``init_process_group``, so they hold
    copies of its gloo sockets): its peer's collective saw no closed connection while they lived,
    and blocked until the agent SIGKILLed it after the failure grace; with ``--run-path`` (fork)
    a kill's "detect" took 2.1 s (1 s grace, SIGTERM, 1 s, SIGKILL) against 0.2 s now (a 2-rank GPT,
    2 loader workers a rank, two runs each). Now the agent SIGKILLs what is left of the failed
    worker's process group as soon as it sees the failure: the peer's collective fails at once and
    the peer runs its own error path (here: writes the error it got)."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    run_dir = tmp_path / "run"
    mode = ["--start-method", "fork", "--run-path"] if workers == "run-path" else []
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           *mode, "--max-restarts", "0", "--run-dir", str(run_dir), str(script), str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, err[-3000:]
    # Before: no such file, rank 0 was SIGKILLed inside its all_reduce.
    assert (tmp_path / "peer-error.txt").exists(), err[-3000:]
    # Script workers: the agent's SIGTERM to rank 0's group ends its loader processes too (this
    # script's SIG_IGN is no CheckpointManager's handler, which spare.py spares them for), and
    # torch's SIGCHLD handler raises that first when the collective returns to Python.
    got = (tmp_path / "peer-error.txt").read_text()
    assert any(w in got for w in ("Connection", "Read error", "DataLoader")), got


DOCTOR_SCRIPT = '''
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

train_ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
val_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))


def trainguard_state():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = tg.ResumableSampler(len(train_ds), seed=0)
    state = {"model": model, "optim": optimizer, "data": sampler, "rng": tg.RNGState(),
             "progress": tg.StateDict(step=-1)}
    return state, {"root": ROOT, "save": tg.EveryNSteps(10), "keep": tg.KeepLatest(2)}


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def main():
    state, settings = trainguard_state()
    model, optimizer, sampler = state["model"], state["optim"], state["data"]
    train_loader = DataLoader(train_ds, batch_size=8, sampler=sampler, generator=torch.Generator())
    val_loader = DataLoader(val_ds, batch_size=8)
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        step = -1 if start is None else start
        for x, y in train_loader:
            step += 1
            train_step(model, optimizer, x, y)
            sampler.advance(len(x))
            if step % 4 == 3:
                model.eval()
                with torch.no_grad():
                    PASS
                model.train()
            mgr.save(step, state)


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("val_pass, severity", [
    ("vl = sum(F.mse_loss(model(x), y).item() for x, y in val_loader) / len(val_loader)", "ok"),
    ("vl = [F.mse_loss(model(x), y).item() for i, (x, y) in enumerate(val_loader)]", "ok"),
    ("vl = [train_step(model, optimizer, x, y) for x, y in val_loader]", "warning"),  # trains: still reported
])
def test_doctor_takes_a_validation_pass_written_as_a_comprehension_for_a_pass(tmp_path, val_pass, severity):
    """A validation loader without ``generator=`` iterated in a generator expression (this session's
    GPT script: ``sum(F.cross_entropy(...).item() for _, xy in val_loader) / len(val_loader)``) was
    reported by "data randomness" as a training loader ("once after a restore ... dropout and every
    later draw differ"), though docs/data.md says such a loader resumes and the doctor does not
    report it, and the script resumed bit-identically (validation losses too). Only ``for`` loops
    were recognised as passes."""
    import json

    from click.testing import CliRunner

    from trainguard.commands.plan import doctor_cmd

    script = tmp_path / "train.py"
    script.write_text(DOCTOR_SCRIPT.replace("ROOT", repr(str(tmp_path / "ckpts"))).replace("PASS", val_pass))
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert res.exit_code == 0, res.output
    found = [f for f in json.loads(res.output) if f["check"] == "data randomness"]
    assert len(found) == 1 and found[0]["severity"] == severity, found


def test_inspect_shows_each_entrys_plain_values(tmp_path):
    """Checking where a resume goes on, ``trainguard inspect`` of the GPT run's checkpoint showed
    ``data`` and ``progress`` as bare names (their values are no tensors): the sampler's epoch and
    position, the step, the scheduler's ``last_epoch`` were in ``manifest.json`` only. Now the text
    shows them beside the entry's name and ``--json`` under the entry's ``values``."""
    import json

    import torch
    from click.testing import CliRunner

    import trainguard as tg
    from trainguard.commands.checkpoints import inspect_cmd

    sampler = tg.ResumableSampler(512, seed=0)
    sampler.advance(64)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    path = str(tmp_path / "step-000000007")
    tg.save(path, {"model": model, "optim": opt, "sched": sched, "data": sampler, "progress": tg.StateDict(step=7),
                   "tokens": 12.5})
    res = CliRunner().invoke(inspect_cmd, [path])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(ln.endswith("data  epoch=0, position=64, seed=0, num_samples=512, shuffle=True") for ln in lines), res.output
    assert any(ln.endswith("progress  step=7") for ln in lines), res.output
    assert any(ln.endswith("tokens  12.5") for ln in lines), res.output
    assert any("sched  step_size=3" in ln for ln in lines), res.output
    assert any(ln.endswith("model") for ln in lines), res.output  # tensors only: no values shown
    d = json.loads(CliRunner().invoke(inspect_cmd, [path, "--json"]).output)["entries"]
    assert d["data"]["values"] == {"epoch": 0, "position": 64, "seed": 0, "num_samples": 512, "shuffle": True}
    assert d["progress"]["values"] == {"step": 7} and d["tokens"]["values"] == 12.5
    assert d["optim"]["values"]["param_groups"][0]["lr"] == 0.5 and "values" not in d["model"]
    # --filter shows tensors only, as before
    out = CliRunner().invoke(inspect_cmd, [path, "--filter", "model/*"]).output
    assert "position" not in out and "weight" in out, out


def test_a_partly_loaded_corrupt_checkpoints_message_reads_as_two_sentences(tmp_path):
    """``restore`` falling back past the GPT run's corrupted newest checkpoint warned "...: the
    checkpoint is corrupt The load had begun writing into the state ...": the note on a partial
    load was glued to the error without a full stop."""
    import torch

    import trainguard as tg

    path = tmp_path / "step-000000001"
    tg.save(str(path), {"a": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 64)})
    data = next(p for p in sorted(path.iterdir()) if p.name.endswith(".bin"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # the last tensor's bytes: the first ones were read into the state already
    data.write_bytes(bytes(raw))
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(str(path), {"a": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 64)})
    assert "the checkpoint is corrupt. The load had begun writing into the state" in str(e.value), str(e.value)


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ddp_gpt.py")


def _run_gpt(run_dir, *args, nproc=2, fast=True):
    """``trainguard run`` of examples/ddp_gpt.py; returns (exit code, stdout, stderr)."""
    mode = ["--start-method", "fork", "--run-path"] if fast else []
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", str(nproc),
           *mode, "--run-dir", str(run_dir), *[a for a in args if a.startswith("--fault")],
           EXAMPLE, *[a for a in args if not a.startswith("--fault")]]
    cmd = [c for a in cmd for c in (a.split("=", 1) if a.startswith("--fault=") else [a])]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    try:
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out, err


def _metrics(run_dir):
    """Each optimizer step's records of the metrics log, in the order written (a replayed step twice)."""
    import json
    from collections import defaultdict

    rows = defaultdict(list)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                rows[r["step"]].append(r)
    return rows


def test_example_ddp_gpt_killed_rank_resumes_bit_identically(tmp_path):
    """examples/ddp_gpt.py under ``trainguard run`` (fork, ``--run-path``): rank 1 SIGKILLed at step 12
    with its DataLoader processes and an async save behind it; the job restarts from step 10, the
    steps it trains again have the losses, learning rates and samples they had (bit for bit), and
    over the run each sample is read once."""
    run = tmp_path / "run"
    rc, out, err = _run_gpt(run, "--fault=step=12,rank=1,kind=kill", "--steps", "20", "--save-every", "5")
    assert rc == 0, err[-3000:]
    assert "resumed from step 10 at world size 2" in out and "done at step 19, saved step 19" in out, out
    rows = _metrics(run)
    assert sorted(rows) == list(range(20))
    replayed = {s: r for s, r in rows.items() if len(r) > 1}
    assert set(replayed) == {11, 12}, sorted(replayed)  # logged before the kill, and again after the restore
    assert all(r[0] == r[1] for r in replayed.values()), replayed
    read = [i for s in range(20) for rank in rows[s][-1]["samples"] for i in rank]
    assert len(read) == 20 * 16 and len(set(read)) == len(read)


@pytest.mark.slow  # three trainguard runs and a straight one (~60 s here)
def test_example_ddp_gpt_goes_on_at_the_same_sample_through_world_sizes_2_1_2(tmp_path):
    """The same example stopped at step 13 on 2 ranks, resumed on 1 until step 29 and on 2 again to
    step 39 (an epoch is 32 steps of 16 samples): every step trains on the samples the straight
    2-rank run's step did, and epoch 0's 512 samples are each read once."""
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    assert _run_gpt(straight, "--steps", "40")[0] == 0
    for nproc, steps in ((2, "14"), (1, "30"), (2, "40")):
        rc, out, err = _run_gpt(moved, "--steps", steps, nproc=nproc)
        assert rc == 0, err[-3000:]
    assert "resumed from step 29 at world size 2" in out, out
    a, b = _metrics(straight), _metrics(moved)
    assert sorted(a) == sorted(b) == list(range(40))
    for s in range(40):
        assert sorted(sum(a[s][-1]["samples"], [])) == sorted(sum(b[s][-1]["samples"], [])), s
    assert {b[s][-1]["world"] for s in range(14, 30)} == {1}
    epoch0 = [i for s in range(32) for rank in b[s][-1]["samples"] for i in rank]
    assert sorted(epoch0) == list(range(512))
