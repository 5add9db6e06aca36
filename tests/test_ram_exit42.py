"""A job that ends without ``close()`` while its RAM tier copies the last checkpoint to disk: the
interpreter's exit waits for that copy (``exitdrain``), after the async save in flight. Before, the
copy's daemon thread died with the process and the checkpoint was left in RAM only: a restart on
another node started over."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import run_py

SCRIPT = textwrap.dedent('''
    import sys, threading, torch
    import trainguard as tg
    from trainguard import tiers
    root, base, use_async = sys.argv[1], sys.argv[2], sys.argv[3] == "async"
    exiting, draining = threading.Event(), threading.Event()
    threading._register_atexit(exiting.set)  # registered after trainguard's exit hook: runs before it
    persist, wait = tiers.RamTier.persist, tiers.RamTier.wait

    def held(self, step):
        # the copy to disk is still running when the exit waits for it: held until the main thread waits
        # (only exiting: an async save still in flight at the exit starts the copy after it, and a small
        # copy then ended before the exit looked, without the message; seen under load)
        assert draining.wait(60)
        return persist(self, step)

    def waited(self):
        if exiting.is_set() and threading.current_thread() is threading.main_thread():
            draining.set()  # exitdrain's drain_copies, after its message
        return wait(self)

    tiers.RamTier.persist, tiers.RamTier.wait = held, waited
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, async_save=use_async,
                               handle_signals=False).open()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    torch.save(model.state_dict(), sys.argv[4])
    mgr.save(1, {"model": model})
    print("exiting without close()", flush=True)
''')


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_exit_waits_for_the_ram_tiers_copy_of_the_last_checkpoint(tmp_path: Path, mode: str) -> None:
    import torch

    import trainguard as tg

    script, root, base, ref = tmp_path / "job.py", tmp_path / "run", tmp_path / "shm", tmp_path / "ref.pt"
    script.write_text(SCRIPT)
    base.mkdir()
    r = run_py([str(script), str(root), str(base), mode, str(ref)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "waiting for the RAM tier's copy of step 1" in r.stderr
    assert (root / "step-000000001" / "manifest.json").exists()  # before: only in RAM
    model = torch.nn.Linear(4, 4)
    tg.load(root / "step-000000001", {"model": model})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), torch.load(ref).values()))
