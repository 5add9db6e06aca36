"""Session 45: items of session 44's "left alone" list, each checked against the code before it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import trainguard as tg
from test_hunt44_resume import EMA_LOOP
from trainguard.doctor import Finding, Settings, check
from trainguard.permanent import is_flag

from conftest import ROOT, TESTS


def _ema(src: str, state: dict) -> list[Finding]:
    return [f for f in check(state, Settings(source=src)) if f.check == "ema"]


def test_doctor_ema_held_by_the_hooks_state_as_its_module_is_ok() -> None:
    """Before: a hook returning ``{"ema": ema.module}`` (timm's and torch's averaged module: an
    ordinary ``nn.Module``, not an ``AveragedModel``) got 'is updated at each step ... but is not in
    the state'."""
    model = torch.nn.Linear(2, 2)
    inner = torch.nn.Linear(2, 2)
    for key in ("ema", "model_ema", "ema_model"):
        (f,) = _ema(EMA_LOOP % "", {"model": model, key: inner})
        assert f.severity == "ok", (key, f)
    (f,) = _ema(EMA_LOOP % "", {"model": model, "ema": {"weight": inner.weight}})  # a state_dict of it
    assert f.severity == "ok", f
    # a state that holds neither the average's class nor a key named like it is still reported
    (f,) = _ema(EMA_LOOP % "", {"model": model, "schema": inner, "head": inner})
    assert f.severity == "warning", f


def test_flags_take_bools_and_integers_of_numpy_and_torch_and_refuse_floats_alike(tmp_path) -> None:
    """Before: ``torch.tensor(1.0)`` and ``np.float64(1.0)`` were taken as flags where ``1.0`` was not."""
    for ok in (True, False, 0, 1, np.True_, np.int64(1), torch.tensor(True), torch.tensor([0])):
        assert is_flag(ok), ok
    for bad in (1.0, torch.tensor(1.0), np.float64(1.0), "no", 2, torch.tensor([True, False]), None,
                torch.tensor(True, device="meta")):  # meta: "Tensor.item() cannot be called on meta tensors" before
        assert not is_flag(bad), bad
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"overwrite=tensor\(1\.\).*pass True or False"):
        tg.save(tmp_path / "a", {"model": m}, overwrite=torch.tensor(1.0))
    assert not (tmp_path / "a").exists()


def test_ram_tier_takes_a_numpy_or_torch_bool(tmp_path) -> None:
    """Before: ``ram_tier=np.True_`` (``cfg.ram_tier`` of a numpy config) was refused with 'pass True
    (/dev/shm), ...'; ``ram_tier=1`` is still refused (an int is no tier)."""
    for on in (np.True_, torch.tensor(True)):
        mgr = tg.CheckpointManager(tmp_path / "run", ram_tier=on)
        try:
            assert mgr.ram is not None and str(mgr.ram.dir).startswith("/dev/shm/"), mgr.ram
        finally:
            mgr.close()
    assert tg.CheckpointManager(tmp_path / "run", ram_tier=np.False_).ram is None
    with pytest.raises(TypeError, match="ram_tier=1: pass True"):
        tg.CheckpointManager(tmp_path / "run", ram_tier=1)


def test_save_handle_waits_refuse_a_timeout_that_is_not_seconds(tmp_path) -> None:
    """Before: ``handle.result(timeout="5")`` failed inside ``threading`` ("'<' not supported between
    instances of 'str' and 'int'"), after the wait had started."""
    h = tg.save(tmp_path / "c", {"model": torch.nn.Linear(2, 2)}, async_=True)
    for call in (h.result, h.wait_staged):
        for bad in ("5", -1, True):
            with pytest.raises(TypeError, match=rf"{call.__name__}\(timeout={bad!r}\): pass seconds"):
                call(timeout=bad)
    assert h.wait_staged(timeout=60) is True
    h.result(timeout=60)
    assert h.done()
    assert tg.verify(tmp_path / "c").ok


def test_sampler_flags_refuse_a_string(tmp_path) -> None:
    """Before: ``ResumableSampler(shuffle="no")`` shuffled (a truthy string); ``drop_last="no"`` dropped."""
    with pytest.raises(TypeError, match="shuffle='no': pass True or False"):
        tg.ResumableSampler(10, shuffle="no", rank=0, world_size=1)
    with pytest.raises(TypeError, match="drop_last='no': pass True or False"):
        tg.ResumableIterable(lambda e: range(4), drop_last="no", rank=0, world_size=1)
    s = tg.ResumableSampler(10, shuffle=np.False_, rank=0, world_size=1)
    assert s.shuffle is False and list(s) == list(range(10))


HOLDER = """
import sys, torch, trainguard as tg
m = torch.nn.Linear(2, 2)
with tg.CheckpointManager(sys.argv[1], handle_signals=False) as mgr:
    mgr.save(1, {"model": m}, force=True)
    mgr.wait()
    print("saved", flush=True)
    sys.stdin.read()
"""


def test_a_plain_save_into_a_live_runs_step_directory_is_refused(tmp_path) -> None:
    """Before: ``tg.save("run/step-000000001", state, overwrite=True)`` replaced the checkpoint of a
    run whose manager (another process) held the run lock; now refused, naming the holder, and the
    checkpoint stays. A name that is no step's (``run/best``) is still saved; once the manager is
    gone the step directory may be replaced again."""
    run = tmp_path / "run"
    step = run / "step-000000001"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT / "src")]))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env)
    bound = threading.Timer(120, holder.kill)
    bound.start()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"saved"
        before, after, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        tg.load(step, {"model": before})
        with pytest.raises(tg.CheckpointError, match=rf"step-000000001 is a step directory of the run .*pid {holder.pid} "):
            tg.save(step, {"model": other}, overwrite=True)
        tg.load(step, {"model": after})
        assert torch.equal(after.weight, before.weight) and not torch.equal(after.weight, other.weight)
        assert tg.verify(step).ok and not [p for p in run.iterdir() if ".tmp" in p.name]
        tg.save(run / "best", {"model": other})  # not a step's name: the manager never touches it
        assert tg.verify(run / "best").ok
    finally:
        holder.communicate(b"", timeout=120)
        bound.cancel()
    assert holder.returncode == 0
    tg.save(step, {"model": other}, overwrite=True)  # the lock is free: replaced as before
    tg.load(step, {"model": after})
    assert torch.equal(after.weight, other.weight)


def test_a_plain_save_into_a_step_of_this_processes_manager_is_refused(tmp_path) -> None:


    m = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.save(3, {"model": m}, force=True)
        mgr.wait()
        with pytest.raises(tg.CheckpointError, match=r"a CheckpointManager of this process\).*mgr\.save\(step, state, force=True\)"):
            tg.save(tmp_path / "run" / "step-000000003", {"model": torch.nn.Linear(2, 2)}, overwrite=True)
        mgr.save(4, {"model": m}, force=True)  # the manager's lock was not dropped by the check
    got = torch.nn.Linear(2, 2)
    tg.load(tmp_path / "run" / "step-000000003", {"model": got})
    assert torch.equal(got.weight, m.weight)


def test_the_event_log_creates_its_directory_once_not_after_it_was_removed(tmp_path, caplog) -> None:
    """Before: every event made the log's directory again: a run directory removed while the job ran
    (``rm -rf``) came back, holding only ``events.jsonl``. The first line still creates it (the
    elastic agent logs before any worker opened the run directory)."""
    import logging
    import shutil

    from trainguard.events import EventLog, read_events

    run = tmp_path / "a" / "run"
    log = EventLog(run / "events.jsonl")
    log.emit("step", step=1)
    assert [e["step"] for e in read_events(run)] == [1]
    shutil.rmtree(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        log.emit("step", step=2)
    assert not (tmp_path / "a").exists()
    assert "cannot write the event log" in caplog.text


def ram_copy_kept(run: Path) -> str:
    """A RAM-tier manager of ``run`` that saved step 1 and closed keeping its RAM copy: that copy's directory."""
    with tg.CheckpointManager(run, ram_tier=True, handle_signals=False) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)}, force=True)
        mgr.wait()
        mgr.close(keep_ram_tier=True)
    return mgr.ram.dir


def test_ram_copies_left_under_a_moved_run_directorys_old_path_are_named_at_open(tmp_path, caplog) -> None:
    """Before: a run moved (``mv a b``) and resumed from ``b`` left the RAM copies made for ``a`` in
    /dev/shm without a word (the RAM directory is named by the run directory's real path). Now the
    manager's open names them, their size and how to remove them; they are not removed."""
    import logging
    import shutil

    from trainguard.tiers import ram_dir

    old = ram_copy_kept(tmp_path / "a")
    assert os.path.isdir(os.path.join(old, "step-000000001"))
    shutil.move(tmp_path / "a", tmp_path / "b")
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            with tg.CheckpointManager(tmp_path / "b", ram_tier=True, handle_signals=False) as mgr:
                assert mgr.ram.dir == ram_dir(str(tmp_path / "b")) != old
                assert mgr.restore({"model": torch.nn.Linear(2, 2)}) == 1
        assert f"{old} also holds RAM copies of this run (step-000000001" in caplog.text, caplog.text
        assert f"rm -rf {old}" in caplog.text
        assert os.path.isdir(os.path.join(old, "step-000000001"))  # named, not removed
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard"):  # another run of this user's: not named
            with tg.CheckpointManager(tmp_path / "c", ram_tier=True, handle_signals=False):
                pass
        assert "also holds RAM copies" not in caplog.text
    finally:
        shutil.rmtree(old, ignore_errors=True)


def test_convert_of_a_legacy_pt_torch_cannot_read_gives_no_unpickling_advice(tmp_path) -> None:
    """Before: 'torch.load(weights_only=True) refused it ... if you trust the file, ...
    torch.load(..., weights_only=False)', which fails the same way for a float8 tensor in torch's
    legacy format. A legacy file of float32 tensors still converts."""
    from trainguard.convert import convert

    src = tmp_path / "old.pt"
    torch.save({"w": torch.zeros(4, dtype=torch.float8_e4m3fn)}, src, _use_new_zipfile_serialization=False)
    with pytest.raises(AttributeError):
        torch.load(src, weights_only=False)  # what the old advice said to do
    with pytest.raises(tg.CheckpointError, match=r"legacy format .*with or without weights_only") as e:
        convert(src, tmp_path / "out")
    assert "weights_only=False" not in str(e.value) and not (tmp_path / "out").exists()
    w = torch.arange(6, dtype=torch.float32)
    torch.save({"w": w}, tmp_path / "old32.pt", _use_new_zipfile_serialization=False)
    convert(tmp_path / "old32.pt", tmp_path / "out32")
    got = {"model": {"w": torch.zeros(6)}}
    tg.load(tmp_path / "out32", got)
    assert torch.equal(got["model"]["w"], w)
