"""Edges of save found by a review: empty tensors, directories that are not checkpoints,
overwrite on object stores, nan/inf and tensor metrics, steps saved twice, EverySeconds with
async saves, a failed fsync, a delete cut short, a full disk, lazy conjugate views."""

from __future__ import annotations

import errno
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trainguard as tg
from trainguard import streams
from trainguard.commit import list_steps
from trainguard.consolidate import consolidate
from trainguard.inspect import describe
from trainguard.storage import for_path
from trainguard.storage import local as local_storage

from dist_helper import run_ranks


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit())


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _saves_loads_and_restores(tmp_path: Path, state: dict) -> None:
    m = tg.save(tmp_path / "c", state)
    assert all(c.file in m.files for e in m.tensors.values() for c in e.chunks), m.files
    out = _zeros(state)
    tg.load(tmp_path / "c", out)
    assert _equal(out, state)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        assert mgr.save(1, state) is not None
    out = _zeros(state)
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        assert mgr.restore(out) == 1
    assert _equal(out, state)


# ----------------------------------------------------------------------------- 1. empty tensors
def test_state_of_only_empty_tensors_saves_and_loads(tmp_path):
    _saves_loads_and_restores(tmp_path, {"e": torch.empty(0), "m": torch.empty(0, 4, dtype=torch.int64)})


def test_empty_tensor_in_an_otherwise_empty_second_data_file_saves_and_loads(tmp_path, monkeypatch):
    # The real threshold is 64 MiB: the big tensor fills file 0, the empty one is put in file 1.
    monkeypatch.setattr(streams, "TWO_FILES_FROM", 1024)
    _saves_loads_and_restores(tmp_path, {"big": torch.randn(1000), "e": torch.empty(0)})


def _empty_on_ranks(rank: int, world: int, root: str) -> list[int | None]:
    torch.manual_seed(0)
    state = {"w": torch.randn(100), "e": torch.empty(0)}  # rank 1 writes only the empty chunk
    tg.save(f"{root}/plain/step-000000001", state)
    out = _zeros(state)
    tg.load(f"{root}/plain/step-000000001", out)
    assert _equal(out, state)
    with tg.CheckpointManager(f"{root}/run", save=tg.EveryNSteps(1), handle_signals=False, timeout=60) as mgr:
        mgr.save(1, state)
    out = _zeros(state)
    with tg.CheckpointManager(f"{root}/run", handle_signals=False, timeout=60) as mgr:
        step = mgr.restore(out)
    assert _equal(out, state)
    return [step]


def test_empty_tensor_saved_by_two_ranks_loads_and_restores(tmp_path):
    res = run_ranks(_empty_on_ranks, 2, str(tmp_path), timeout=90)
    assert [r.value for r in res] == [[1], [1]]


# ------------------------------------------------------------- 2. directories that are not ours
def test_save_into_a_directory_holding_foreign_files_is_refused_and_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.randn(4)})
    mine = tmp_path / "mydir"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    before = {d: _files(d) for d in (run, mine)}
    for d, named in [(run, "events.jsonl"), (mine, "notes.txt")]:
        with pytest.raises(tg.CheckpointError, match=named):
            tg.save(d, {"w": torch.randn(4)})
    assert {d: _files(d) for d in (run, mine)} == before
    assert sorted(os.listdir(tmp_path)) == ["mydir", "run"]  # no temp or .old- directories either
    # Debris of our own (a data file, no manifest) is still saved into.
    debris = tmp_path / "debris"
    debris.mkdir()
    (debris / "data-00000.bin").write_bytes(b"junk")
    w = {"w": torch.randn(4)}
    tg.save(debris, w)
    out = _zeros(w)
    tg.load(debris, out)
    assert _equal(out, w)


def test_save_onto_a_regular_file_is_refused(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(tg.CheckpointError, match="is a file"):
        tg.save(f, {"w": torch.randn(4)})
    assert f.read_bytes() == b"not a checkpoint" and os.listdir(tmp_path) == ["model.pt"]


def test_consolidate_into_a_directory_holding_foreign_files_is_refused(tmp_path):
    tg.save(tmp_path / "src", {"w": torch.randn(4)})
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("precious")
    with pytest.raises(tg.CheckpointError, match="notes.txt"):
        consolidate(tmp_path / "src", dst)
    assert _files(dst) == {"notes.txt": b"precious"}
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


# ---------------------------------------------------------- 3. overwrite on an object store
def test_overwrite_on_fsspec_memory_is_refused_before_anything_is_written(monkeypatch):
    pytest.importorskip("fsspec")
    from trainguard.storage.fsspec import FsspecStorage

    url = f"memory://tg-{uuid.uuid4().hex[:10]}/step-000000001"
    storage, path = for_path(url)
    w1 = {"w": torch.arange(1000.0)}
    tg.save(url, w1)
    try:
        before = {p: storage.fs.cat_file(p) for p in storage.fs.find(path)}
        opened: list[str] = []
        real_open = FsspecStorage.open_write
        monkeypatch.setattr(FsspecStorage, "open_write", lambda s, p, **k: opened.append(p) or real_open(s, p, **k))
        with pytest.raises(tg.CheckpointError, match="atomically"):
            tg.save(url, {"w": torch.zeros(1000)}, overwrite=True)
        assert opened == []
        assert {p: storage.fs.cat_file(p) for p in storage.fs.find(path)} == before
        out = _zeros(w1)
        tg.load(url, out)
        assert _equal(out, w1)
    finally:
        storage.fs.rm(path.split("/step-")[0], recursive=True)


# ----------------------------------------------------------------------- 4. metadata, metrics
def test_nan_inf_tensor_and_numpy_metrics_are_stored_and_keep_best_ranks_nan_last(tmp_path):
    state = {"w": torch.randn(8)}
    losses = [float("nan"), 0.5, float("inf"), torch.tensor(0.25), np.float64(0.375)]
    survivors = [[1], [1, 2], [2, 3], [2, 4], [4, 5]]  # at step 3, nan goes before inf
    stored = []
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", n=2),
                              handle_signals=False) as mgr:
        for step, (loss, alive) in enumerate(zip(losses, survivors), start=1):
            assert mgr.save(step, state, metrics={"loss": loss}) is not None
            stored.append(describe(tmp_path / f"step-{step:09d}").metadata["metrics"]["loss"])
            assert _steps(tmp_path) == alive, step
    assert math.isnan(stored[0]) and stored[1:] == [0.5, math.inf, 0.25, 0.375]
    assert all(type(v) is float for v in stored)


def test_non_number_metrics_are_refused_at_the_call_and_write_nothing(tmp_path):
    state = {"w": torch.randn(8)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state, metrics={"loss": 1.0})
        for step, bad in [(2, "low"), (3, torch.ones(2)), (3, np.array([1.0, 2.0]))]:
            with pytest.raises(tg.UnsupportedValueError, match="loss"):
                mgr.save(step, state, metrics={"loss": bad})
        assert [n for n in os.listdir(tmp_path) if n.startswith("step-")] == ["step-000000001"]
        assert mgr.save(4, state, metrics={"loss": 0.5}) is not None  # the manager goes on
    assert _steps(tmp_path) == [1, 4]


def test_metadata_keeps_nan_and_inf_and_refuses_tensors_before_writing(tmp_path):
    tg.save(tmp_path / "a", {"w": torch.randn(4)}, metadata={"lr": float("nan"), "best": -math.inf, "n": 3})
    meta = describe(tmp_path / "a").metadata
    assert math.isnan(meta["lr"]) and meta["best"] == -math.inf and meta["n"] == 3
    with pytest.raises(tg.UnsupportedValueError, match="metadata"):
        tg.save(tmp_path / "b" / "step-000000001", {"w": torch.randn(4)}, metadata={"x": torch.ones(2)})
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------- 5. a step saved twice
def _st(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "progress": tg.StateDict(step=step)}


def test_forced_save_of_a_step_the_policy_just_saved_returns_none(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), handle_signals=False) as mgr:
        for s in range(1, 6):
            mgr.save(s, _st(s))
        assert mgr.save(5, _st(99), force=True) is None
        assert mgr.last_saved_step == 5
    out = _st(0)
    tg.load(tmp_path / "step-000000005", out)
    assert out["progress"]["step"] == 5


def test_step_restore_rejected_is_replaced_when_reached_again_and_takes_no_slot(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for s in range(1, 11):
            mgr.save(s, _st(s))
    data = tmp_path / "step-000000010" / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        state = _st(0)
        assert mgr.restore(state) == 5 and state["progress"]["step"] == 5
        mgr.save(6, _st(6))
        # the unusable step 10 took no slot (5 is kept), and, newer than the step this run saved, is gone
        assert _steps(tmp_path) == [5, 6]
        for s in range(7, 11):
            assert mgr.save(s, _st(s)) is not None
        assert _steps(tmp_path) == [9, 10]
    assert tg.verify(tmp_path / "step-000000010").ok
    state = _st(0)
    with tg.CheckpointManager(tmp_path, handle_signals=False) as mgr:
        assert mgr.restore(state) == 10
    assert state["progress"]["step"] == 10 and torch.equal(state["w"], _st(10)["w"])


# ------------------------------------------------------------------------ 6. EverySeconds
class _Clock:
    """The manager's ``time`` module, with a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    time = staticmethod(time.time)


def test_every_seconds_with_async_saves_never_saves_two_steps_in_a_row(tmp_path, monkeypatch):
    from trainguard import manager as manager_mod

    clock = _Clock()
    monkeypatch.setattr(manager_mod, "time", clock)
    state, saved = {"w": torch.randn(256)}, []
    with tg.CheckpointManager(tmp_path, save=tg.EverySeconds(10), keep=tg.KeepAll(), async_save=True,
                              handle_signals=False) as mgr:
        for step in range(1, 21):
            clock.now += 3.0  # a 3 s step: a save every 4th or 5th step
            if mgr.save(step, state) is not None:
                saved.append(step)
    assert len(saved) >= 3, saved
    assert all(3 * (b - a) >= 10 for a, b in zip(saved, saved[1:])), saved
    assert _steps(tmp_path) == saved


def test_every_seconds_restarts_its_clock_when_it_says_yes():
    pol = tg.EverySeconds(10)
    pol.on_step(1, 100.0)
    assert not pol.should_save(1, 100.0)
    pol.on_step(2, 110.0)
    assert pol.should_save(2, 110.0)
    assert pol.should_save(2, 110.5)  # the same step asked again: the same answer
    pol.on_step(3, 111.0)
    assert not pol.should_save(3, 111.0)  # an async save's on_saved comes later: already restarted
    pol.on_saved(2, 0.1, 0.2)
    pol.on_step(4, 119.0)
    assert not pol.should_save(4, 119.0)
    pol.on_step(5, 120.0)
    assert pol.should_save(5, 120.0)
    pol.on_saved(5, 0.1, 0.2)
    pol.on_step(7, 125.0)
    assert not pol.should_save(7, 125.0)
    pol.on_saved(7, 0.1, 0.2)  # a forced save: the clock restarts at the next step
    pol.on_step(8, 126.0)
    assert not pol.should_save(8, 131.0)  # 11 s after step 5's save, 5 s after the forced one
    assert pol.should_save(9, 136.0)


def test_every_seconds_keeps_its_interval_when_on_saved_comes_a_save_later():
    def replay(async_order: bool) -> list[int]:
        pol, saved = tg.EverySeconds(10), []
        for step in range(1, 25):  # 3 s steps
            pol.on_step(step, 3.0 * step)
            if pol.should_save(step, 3.0 * step):
                if async_order and saved:
                    pol.on_saved(saved[-1], 0.0, 1.0)  # the manager collects the previous save now
                saved.append(step)
                if not async_order:
                    pol.on_saved(step, 0.0, 1.0)
        return saved

    assert replay(async_order=True) == replay(async_order=False)  # was one step late after each save


# ------------------------------------------------------------------- 7. a failed fsync
def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_failed_fsync_closes_the_data_file_descriptor_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "0")  # one descriptor per data file
    real_fsync, real_close = os.fsync, os.close
    seen: dict[str, int] = {}
    victim_path = str(tmp_path / "training.log")

    def fsync(fd: int) -> None:
        if "fd" not in seen and _fd_target(fd).endswith(".bin"):
            seen["fd"] = fd
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_fsync(fd)

    def close(fd: int) -> None:
        real_close(fd)
        if fd == seen.get("fd") and "victim" not in seen:  # another thread opens a file right now
            seen["victim"] = os.open(victim_path, os.O_WRONLY | os.O_CREAT, 0o644)

    monkeypatch.setattr(local_storage.os, "fsync", fsync)
    monkeypatch.setattr(local_storage.os, "close", close)
    try:
        with pytest.raises(tg.CheckpointError):
            tg.save(tmp_path / "c" / "step-000000001", {"w": torch.randn(1000)})
        monkeypatch.undo()
        assert seen["victim"] == seen["fd"]  # it got the writer's number: the hazard was there
        assert _fd_target(seen["victim"]) == victim_path, "the victim's descriptor was closed by the save"
        os.fstat(seen["victim"])
    finally:
        monkeypatch.undo()
        if "victim" in seen and _fd_target(seen["victim"]) == victim_path:
            os.close(seen["victim"])


# ------------------------------------------------------------- 8. a delete cut short
def test_remove_tree_cut_short_leaves_no_committed_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, _st(1))
        mgr.save(2, _st(2))
    storage, root = for_path(run)

    def rmtree(path: str, ignore_errors: bool = False) -> None:
        os.unlink(os.path.join(path, "data-00000.bin"))  # rmtree's first unlink, then the crash
        raise RuntimeError("process died in the middle of a delete (injected)")

    from trainguard.storage import _durable

    monkeypatch.setattr(_durable, "shutil", SimpleNamespace(rmtree=rmtree, disk_usage=shutil.disk_usage))
    with pytest.raises(RuntimeError, match="injected"):
        storage.remove_tree(storage.join(root, "step-000000001"))
    monkeypatch.undo()
    assert [(s.step, s.status) for s in list_steps(storage, root)] == [(1, "incomplete"), (2, "committed")]
    state = _st(0)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert _steps(run) == [2]  # open() cleaned it
        assert mgr.restore(state) == 2


# ------------------------------------------------------------------------ 9. disk full
def test_disk_full_in_a_one_process_save_raises_disk_full_error_and_keeps_previous(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "0")
    ckpt = tmp_path / "step-000000001"
    w1 = {"w": torch.randn(1000)}
    tg.save(ckpt, w1)
    real_pwrite = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if _fd_target(fd).endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local_storage.os, "pwrite", pwrite)
    with pytest.raises(tg.DiskFullError, match="no space left"):
        tg.save(ckpt, {"w": torch.zeros(1000)}, overwrite=True)
    with pytest.raises(tg.DiskFullError, match="no space left"):
        tg.save(tmp_path / "step-000000002", {"w": torch.zeros(1000)})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["step-000000001"]  # no partial or temp directory left
    assert tg.verify(ckpt).ok
    out = _zeros(w1)
    tg.load(ckpt, out)
    assert _equal(out, w1)


# ---------------------------------------------------------------------- 10. conj views
def test_conj_view_is_refused_naming_its_path_and_resolved_round_trips(tmp_path):
    z = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(tg.UnsupportedValueError, match=r"model/z: .*resolve_conj"):
        tg.save(tmp_path / "c", {"model": {"z": z.conj()}})
    assert not (tmp_path / "c").exists()
    tg.save(tmp_path / "c", {"model": {"z": z.conj().resolve_conj()}})
    out = {"model": {"z": torch.zeros(4, dtype=torch.complex64)}}
    tg.load(tmp_path / "c", out)
    assert torch.equal(out["model"]["z"], z.conj())
