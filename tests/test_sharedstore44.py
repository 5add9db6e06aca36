"""Under plain ``torchrun`` with ``--max-restarts`` and torch's shared rendezvous store, rank 0 warns
at the manager's open (restarted workers have hung in ``init_process_group``); not with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (what ``trainguard run`` sets) nor without restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = """
import logging, sys
import trainguard as tg
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
with tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1), handle_signals=False) as mgr:
    mgr.save(1, {"progress": tg.StateDict(step=1)})
print("SAVED", mgr.latest_step())
"""


def _torchrun(tmp_path: Path, restarts: int, share: bool) -> str:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    if not share:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "--max-restarts", str(restarts), str(script), str(tmp_path / f"run-{restarts}-{share}")],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "SAVED 1" in out.stdout, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.parametrize(("restarts", "share", "warned"), [(2, True, True), (2, False, False), (0, True, False)])
def test_plain_torchrun_with_restarts_and_the_shared_store_is_warned(tmp_path: Path, restarts: int, share: bool,
                                                                       warned: bool) -> None:
    text = _torchrun(tmp_path, restarts, share)
    assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text) == warned, text
