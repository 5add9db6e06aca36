"""Concurrency: a second job on the same run directory fails at start with a clear message; the
lock of a killed job is taken over; ``ls``/``verify`` are safe while a save is in progress."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main as cli_main
from trainguard.inspect import list_checkpoints
from trainguard.storage import local


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(50_000, generator=g), "progress": tg.StateDict(step=step)}


def _second_job(root: str, out: str) -> None:
    """Runs in another process: try to open the run directory another job holds."""
    try:
        with tg.CheckpointManager(root, handle_signals=False):
            Path(out).write_text("OPENED")
    except tg.CheckpointError as e:
        Path(out).write_text(f"{type(e).__name__}: {e}")


def _killed_job(root: str) -> None:
    """Runs in another process: take the lock, save once, die without releasing anything."""
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False).open()
    mgr.save(1, _state(1))
    os.kill(os.getpid(), signal.SIGKILL)


def _run(target, *args) -> int:
    ctx = mp.get_context("forkserver")
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join(5)
    return p.exitcode


def test_second_job_fails_at_start_then_stale_lock_is_taken_over(tmp_path):
    root = tmp_path / "run"
    out = tmp_path / "second.txt"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1))
        assert _run(_second_job, str(root), str(out)) == 0
        msg = out.read_text()
        assert msg.startswith("LockedError:"), msg
        assert f"pid {os.getpid()}" in msg and "in use by another job" in msg and "another directory" in msg
        # The refused job touched nothing: the holder keeps saving.
        mgr.save(2, _state(2))
    # The directory is free again once the holder closed.
    assert _run(_second_job, str(root), str(out)) == 0 and out.read_text() == "OPENED"

    stale = tmp_path / "stale"
    assert _run(_killed_job, str(stale)) == -signal.SIGKILL
    with pytest.warns(UserWarning, match="taking over a stale lock"):
        mgr = tg.CheckpointManager(stale, save=tg.EveryNSteps(1), handle_signals=False).open()
    try:
        state = _state(0)
        assert mgr.restore(state) == 1 and torch.equal(state["w"], _state(1)["w"])
    finally:
        mgr.close()


def test_ls_and_verify_while_a_save_is_in_progress(tmp_path, monkeypatch):
    """The background writer is held mid-file (deterministically, by an event), while this
    thread runs ls, verify and the CLI on the same run directory."""
    root = tmp_path / "run"
    entered, release = threading.Event(), threading.Event()
    orig = local._LocalWriter.pwrite

    def held(self, data, offset):
        if "step-000000002" in self.path:
            entered.set()
            assert release.wait(60), "test never released the writer"
        orig(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", held)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        mgr.save(2, _state(2))
        try:
            assert entered.wait(60)
            tmp = [n for n in os.listdir(root) if ".tmp-" in n]
            assert len(tmp) == 1  # the save in progress
            rows = list_checkpoints(root, verify_data=True)
            assert [(r.step, r.status) for r in rows] == [(1, "valid")]
            assert tg.verify(root / "step-000000001").ok
            v = tg.verify(root / tmp[0])
            assert not v.ok and "not a committed checkpoint" in v.errors[0]
            r = CliRunner().invoke(cli_main, ["ls", str(root)])
            assert r.exit_code == 0 and "valid" in r.output and ".tmp-" not in r.output, r.output
        finally:
            release.set()
        mgr.wait()
    assert [(r.step, r.status) for r in list_checkpoints(root, verify_data=True)] == [(1, "valid"), (2, "valid")]
