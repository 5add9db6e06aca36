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
    assert any(w in (tmp_path / "peer-error.txt").read_text() for w in ("Connection", "Read error", "DataLoader"))
