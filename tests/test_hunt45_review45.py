"""Session 45's review of c64c550: cases its changes did not cover, each checked against c64c550."""

from __future__ import annotations

import logging
import math
import os
import shutil

import numpy as np
import pytest
import torch

import trainguard as tg
from test_hunt44_resume import EMA_LOOP
from test_left45 import ram_copy_kept
from trainguard.doctor import Finding, Settings, check
from trainguard.errors import error_text


def _ema(state: dict) -> list[Finding]:
    return [f for f in check(state, Settings(source=EMA_LOOP % "")) if f.check == "ema"]


def test_doctor_ema_not_saved_by_a_number_named_like_it() -> None:
    """c64c550: a key with the word ema/swa/average counted as the saved average whatever it held:
    ``ema_decay=0.999``, ``swa_start=10``, ``average_loss`` (numbers, not weights) made the check say
    'the weight average is saved' while the AveragedModel was not in the state."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for extra in ({"progress": tg.StateDict(step=0, ema_decay=0.999)}, {"progress": {"step": 0, "swa_start": 10}},
                  {"average_loss": 0.5}, {"ema": None}):
        (f,) = _ema({"model": model, "optim": opt, **extra})
        assert f.severity == "warning", (extra, f)
    # weights under such a key still count as the average saved
    inner = torch.nn.Linear(2, 2)
    for extra in ({"model_ema": inner}, {"ema": inner.state_dict()}, {"swa": {"weight": inner.weight}}):
        (f,) = _ema({"model": model, "optim": opt, **extra})
        assert f.severity == "ok", (extra, f)


def test_save_handle_waits_take_numpy_integers_and_infinity(tmp_path) -> None:
    """c64c550: ``result(timeout=np.int64(5))`` (a value computed with numpy) raised TypeError, where it
    waited before; ``timeout=math.inf`` raised ``OverflowError: timestamp out of range`` from threading."""
    h = tg.save(tmp_path / "c", {"w": torch.ones(4)}, async_=True)
    for t in (np.int64(600), math.inf, np.float32(600.0)):
        assert h.wait_staged(timeout=t) is True
        assert h.result(timeout=t) is not None
    for bad in ("5", -1, float("nan"), True):
        with pytest.raises(TypeError, match="pass seconds"):
            h.result(timeout=bad)


def test_error_text_of_an_error_raised_from_a_store_answer_that_is_not_an_oserror() -> None:
    """c64c550: ``error_text`` of an error caused by an object store's answer read ``e.strerror``,
    which only an OSError has: ``RuntimeError(...)`` raised from a botocore ``ClientError`` gave
    AttributeError in place of the message (``api.save``'s failure, ``_diskfull``)."""
    botocore = pytest.importorskip("botocore.exceptions")
    cause = botocore.ClientError({"Error": {"Code": "InternalError", "Message": "We encountered an internal error"},
                                  "ResponseMetadata": {"HTTPStatusCode": 500}}, "DeleteObjects")
    try:
        try:
            raise cause
        except botocore.ClientError as c:
            raise RuntimeError("upload failed") from c
    except RuntimeError as e:
        text = error_text(e)
    assert text == "RuntimeError: the object store answered HTTP 500 (InternalError): upload failed", text


def test_ram_tier_open_is_not_failed_by_a_step_of_another_ram_directory_it_cannot_scan(tmp_path, caplog) -> None:
    """c64c550: ``left_behind`` (a log line at a RAM-tier manager's open) raised out of the open when a
    step directory of another RAM directory of the run could not be scanned (gone between the listing
    and its size: a live copy of the run removing it; here a dangling ``step-000000002``): the manager
    could not be opened, ``CheckpointError: ... FileNotFoundError``. Now that directory is named with
    the steps it could measure, and the open goes on."""
    from trainguard.tiers import ram_dir

    old = ram_copy_kept(tmp_path / "a")
    try:
        os.symlink(os.path.join(old, "gone"), os.path.join(old, "step-000000002"))
        shutil.move(tmp_path / "a", tmp_path / "b")
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            with tg.CheckpointManager(tmp_path / "b", ram_tier=True, handle_signals=False) as mgr:
                assert mgr.ram.dir == ram_dir(str(tmp_path / "b")) != old
                assert mgr.restore({"model": torch.nn.Linear(2, 2)}) == 1
        assert f"{old} also holds RAM copies of this run (step-000000001" in caplog.text, caplog.text
    finally:
        shutil.rmtree(old, ignore_errors=True)


_TAKE = ("import sys, trainguard as tg\ntry:\n    tg.CheckpointManager(sys.argv[1], handle_signals=False).open().close()\n"
         "    print('taken')\nexcept tg.CheckpointError as e:\n    print('refused', type(e).__name__)")


def test_plain_save_through_another_path_to_this_process_s_run_lock_keeps_the_lock(tmp_path) -> None:
    """c64c550: ``holder_of`` knew this process's locks by the lock file's real path only; the same
    file under another real path (reproduced by hand with ``mount --bind run-parent elsewhere``; here
    a hard link, which needs no privilege) was opened, F_GETLK said "free" (a process's own lock is
    not reported to it), and closing that descriptor dropped this process's POSIX lock: the save into
    the live run's step directory was not refused, and another job could open the run as a writer.
    Now the lock file is matched by its inode."""
    import subprocess
    import sys

    from conftest import ROOT

    run, other = tmp_path / "run", tmp_path / "other"
    other.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

    def take() -> str:
        return subprocess.run([sys.executable, "-c", _TAKE, str(run)], capture_output=True, text=True, env=env,
                              timeout=120).stdout.strip()

    st = {"m": torch.nn.Linear(2, 2)}
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        mgr.save(1, st, force=True)
        os.link(run / ".lock", other / ".lock")
        assert take() == "refused LockedError"
        with pytest.raises(tg.CheckpointError, match="a CheckpointManager of this process"):
            tg.save(other / "step-000000005", st)
        assert take() == "refused LockedError"  # the lock is still this process's
        assert not (other / "step-000000005").exists()
