"""Documentation claims of README.md, docs/checkpoints.md, docs/async.md, docs/storage.md,
docs/reliability.md and SECURITY.md checked against the code (session 41's docs audit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("async_save", [False, True])
def test_a_managers_save_of_a_step_an_earlier_run_left_says_to_restore_sync_and_async(tmp_path, async_save):
    """docs/checkpoints.md: without restore(), "a save of a step the directory already holds raises
    StepExistsError, saying to call mgr.restore(state, step=...) first". An async save met the step in
    its save thread and raised tg.save's own text ("pass overwrite=True", which a manager does not take)."""
    state = {"w": torch.arange(4.0)}
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    with pytest.raises(tg.StepExistsError) as caught:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=async_save, handle_signals=False) as mgr:
            mgr.save(2, state)
            mgr.wait()
    text = str(caught.value)
    assert "mgr.restore(state, step=...)" in text and "overwrite=True" not in text, text
    assert (root / "step-000000002" / "manifest.json").exists()


def test_run_usage_error_is_one_line_without_the_usage_and_the_others_with_theirs():
    """docs/checkpoints.md, "Command line": a malformed command line is one ``error:`` line saying what
    is wrong, the command's usage (not ``trainguard run``'s, which lists all of torchrun's options) and where
    its help is. The docs claimed the usage for ``run`` too."""
    import subprocess
    import sys

    def err(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        return lines[0]

    ls = err("ls", "--bogus", "x")
    assert "--bogus" in ls and "usage: trainguard ls [OPTIONS] RUN_DIR" in ls and "`trainguard ls --help`" in ls, ls
    run = err("run", "--bogus", "train.py")
    assert "--bogus" in run and "usage" not in run and "`trainguard run --help`" in run, run
    text = (Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md").read_text()
    assert "the command's usage (not `trainguard run`'s" in " ".join(text.split())
