"""Disk full: saving onto a filesystem that runs out of space gives a clear CheckpointError
saying the disk is full and how much was needed; earlier checkpoints stay intact, partial
files are removed; with ``on_error="warn"`` training continues and the next save is tried again.

The filesystem is an 8 MiB tmpfs mounted by the test (we run as root in CI); where mounting is
not allowed, the same is checked in a child process under ``RLIMIT_FSIZE``.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.inspect import list_checkpoints

from conftest import run_py

MB = 1 << 20


def state_for(step: int) -> dict:
    """~3 MB: two checkpoints fit in 8 MiB, a third does not."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": {"a": torch.randn(400_000, generator=g), "b": torch.randn(350_000, generator=g)},
        "progress": tg.StateDict(step=step),
    }


@contextmanager
def small_fs(path: Path, size: str = "8m") -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``path``; yields False (nothing mounted) when not allowed."""
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, timeout=30)
    try:
        yield r.returncode == 0
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _names(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def _assert_disk_full_message(msg: str) -> None:
    assert "no space left" in msg.lower(), msg
    assert "bytes were needed" in msg and "bytes are free" in msg and "needs" in msg and "bytes in all" in msg, msg


def test_disk_full_raises_clearly_and_keeps_previous(tmp_path):
    root = tmp_path / "fs"
    with small_fs(root) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here; test_disk_full_under_rlimit_fsize covers this")
        run = root / "run"
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
            mgr.save(1, state_for(1))
            mgr.save(2, state_for(2))
            with pytest.raises(tg.CheckpointError) as ei:
                mgr.save(3, state_for(3))
        msg = str(ei.value)
        _assert_disk_full_message(msg)
        # Previous checkpoints intact, the partial one removed (no temp dir, no step 3).
        assert _names(run) == ["step-000000001", "step-000000002"]
        assert all(tg.verify(run / n).ok for n in _names(run))
        assert [r.status for r in list_checkpoints(run)] == ["valid", "valid"]
        state = state_for(0)
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            assert mgr.restore(state) == 2
        assert torch.equal(state["w"]["a"], state_for(2)["w"]["a"])
        print(f"disk full message: {msg}")


def test_disk_full_with_on_error_warn_keeps_training_and_retries(tmp_path):
    root = tmp_path / "fs"
    with small_fs(root) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here")
        ballast = root / "ballast.bin"
        ballast.write_bytes(b"\0" * (3 * MB))  # something else filling the disk
        run = root / "run"
        state = state_for(1)
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), on_error="warn",
                                  handle_signals=False) as mgr:
            assert mgr.save(1, state) is not None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert mgr.save(2, state) is None  # failed: reported, not raised
            assert any("no space left" in str(w.message).lower() for w in caught), [str(w.message) for w in caught]
            assert _names(run) == ["step-000000001"]
            state["w"]["a"].add_(1.0)  # training continues
            ballast.unlink()  # the operator frees space
            assert mgr.save(3, state) is not None  # the next save is attempted again, and works
            assert mgr.latest_step() == 3
        fresh = state_for(0)
        tg.load(run / "step-000000003", fresh)
        assert torch.equal(fresh["w"]["a"], state["w"]["a"])
        events = (run / "events.jsonl").read_text()
        assert '"save_failed"' in events and "step-000000002" not in _names(run)


CHILD = r"""
import os, resource, signal, sys
import torch
import trainguard as tg
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal past the limit
run = sys.argv[1]
g = torch.Generator().manual_seed(1)
state = {"w": torch.randn(750_000, generator=g)}
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))  # no file may exceed 2 MiB
with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
    try:
        mgr.save(1, state)
    except tg.CheckpointError as e:
        print("ERROR:", e)
print("LEFT:", sorted(os.listdir(run)))
"""


def test_disk_full_under_rlimit_fsize(tmp_path):
    """A per-process file size limit gives EFBIG: reported as such (it had been called a full disk,
    with advice to free space), and nothing is left behind."""
    r = run_py(["-c", CHILD, str(tmp_path / "run")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ERROR:" in r.stdout, r.stdout
    assert "file too large writing" in r.stdout and "ulimit -f" in r.stdout, r.stdout
    assert "bytes were needed" in r.stdout and "bytes in all" in r.stdout and "no space left" not in r.stdout, r.stdout
    assert "LEFT: ['.lock', '.trainguard-run-id', 'events.jsonl']" in r.stdout, r.stdout
