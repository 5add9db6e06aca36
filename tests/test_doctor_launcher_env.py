"""``trainguard doctor`` run inside a launcher's environment (an ``salloc`` shell, a torchrun
job's worker, a notebook started by one) on a script whose ``trainguard_state()`` creates its
process group from ``env://``: the doctor is one process, so the hook waited forever for the
ranks ``WORLD_SIZE`` promised. It now imports and calls the hook without the launcher's
variables: the hook fails at once, and the doctor says why and what to change."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import free_port

HOOK = '''
import torch
import torch.distributed as dist
from torch import nn

def trainguard_state():
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    return {"model": nn.Linear(2, 2)}
'''


def test_doctor_inside_a_launchers_environment_does_not_wait_for_ranks_that_never_come(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOOK)
    port = free_port()
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Before: still waiting for rank 1 when killed (the bound below).
    res = subprocess.run([sys.executable, "-c", "from trainguard.cli import main; main()", "doctor", str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res  # the hook's error: exit 2, not a finding's 1
    assert "RANK" in res.stderr and "create the process group in main()" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
