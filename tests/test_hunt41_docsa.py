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


def test_store_timeout_bounds_an_async_clients_calls_but_not_its_file_objects(monkeypatch):
    """docs/storage.md, "A hung endpoint": TRAINGUARD_STORE_TIMEOUT cuts each call of an async
    filesystem (s3fs's call_s3 uploads, every read, list and delete), but the uploads to a store other
    than S3 go through ``fs.open(path, "wb")``, which takes no bound (a hung one ends in StuckWriteError
    at the manager's timeout instead). The docs claimed every call to gcsfs too."""
    import asyncio

    import fsspec
    from fsspec.asyn import AsyncFileSystem

    from trainguard.storage import for_path

    class Client(AsyncFileSystem):  # as s3fs and gcsfs: async methods, sync wrappers fsspec makes
        protocol = ("hunt41afs",)

        async def _cat_file(self, path, start=None, end=None, **kw):
            await asyncio.Event().wait()  # an endpoint that never answers

        def _open(self, path, mode="rb", **kw):
            raise NotImplementedError

    fsspec.register_implementation("hunt41afs", Client, clobber=True)
    monkeypatch.setenv("TRAINGUARD_STORE_TIMEOUT", "0.5")
    storage, _ = for_path("hunt41afs://b/run")
    with pytest.raises(TimeoutError, match="did not answer cat_file.*TRAINGUARD_STORE_TIMEOUT"):
        storage.io.cat_file("b/run/x")  # a read: cut after the bound
    assert storage.io.open == storage.fs.open  # a file object (non-S3 uploads): the client's own, no bound
    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "storage.md").read_text().split())
    assert "Not cut by it: the uploads to a store other than S3" in text


def test_a_disk_full_reported_at_the_fsync_does_not_say_that_0_bytes_were_needed(tmp_path, monkeypatch):
    """docs/reliability.md, "A full disk": the error says "no space left", what the failing write and
    the whole data file needed and what is free. A file system that reports the lack of space at the
    fsync (NFS does) made it say "0 more bytes were needed here"."""
    import errno
    import os

    from trainguard.storage import local

    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    with pytest.raises(tg.DiskFullError) as caught:
        tg.save(tmp_path / "c", {"w": torch.ones(1 << 20)})
    text = str(caught.value)
    assert "no space left" in text and "at the fsync" in text and "0 more bytes" not in text, text
    assert "bytes are free" in text and "bytes in all" in text, text
    assert not (tmp_path / "c").exists() and os.listdir(tmp_path) == []


def _save_a_step_held(rank: int, world: int, root: str) -> str:
    """Each rank: an async manager with no restore() saves a step the run directory holds."""
    state = {"w": torch.arange(4.0)}
    try:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
            mgr.save(2, state)
            mgr.wait()
    except tg.StepExistsError as e:
        return str(e)
    return "no error"


def test_every_rank_of_an_async_save_of_a_step_held_says_to_restore(tmp_path):
    from dist_helper import run_ranks

    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(2, {"w": torch.arange(4.0)})
    results = run_ranks(_save_a_step_held, 2, str(root), timeout=120)
    for r in results:
        assert "mgr.restore(state, step=...)" in r.value and "overwrite=True" not in r.value, r


@pytest.mark.parametrize("async_save", [False, True])
def test_a_managers_save_of_a_step_an_earlier_run_left_is_an_error_no_restart_fixes(tmp_path, async_save):
    """A script that does not restore() meets the same held step at every restart of ``trainguard run``:
    its StepExistsError exits 78 (not restarted), as docs/elastic.md lists; ``tg.save``'s own
    StepExistsError (a caller may pass overwrite=True or another directory) stays a plain one."""
    state = {"w": torch.arange(4.0)}
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(2, state)
    with pytest.raises(tg.StepExistsError) as caught:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=async_save, handle_signals=False) as mgr:
            mgr.save(2, state)
            mgr.wait()
    assert tg.exit_code_for(caught.value) == 78
    with pytest.raises(tg.StepExistsError) as direct:
        tg.save(root / "step-000000002", state)
    assert tg.exit_code_for(direct.value) == 1
