"""The RAM tier and retention when things go wrong (review 17b): a RAM tier with no room for a
checkpoint, a kept checkpoint whose manifest cannot be read, ``ls --json`` and stale RAM copies."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
import warnings

import pytest
import torch

import trainguard as tg
from test_storage_ram import _steps
from trainguard.tiers import ram_dir


def _big(fill: float) -> torch.nn.Module:
    m = torch.nn.Linear(600, 500)  # 1.2 MB of data
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


def _events(root: str, kind: str) -> list[dict]:
    with open(os.path.join(root, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MB tmpfs (root only: mount), unmounted after the test."""
    base = str(tmp_path / f"shm-{uuid.uuid4().hex[:8]}")
    os.makedirs(base)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", base], capture_output=True, timeout=30).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield base
    finally:
        subprocess.run(["umount", "-l", base], capture_output=True, timeout=30)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_ram_tier_without_room_saves_to_the_run_directory_and_uses_ram_again_when_room_returns(tmp_path, small_tmpfs,
                                                                                                  async_save):
    """A tmpfs that other users (NCCL, DataLoader workers) left with less room than a checkpoint.
    Before, every save failed with ENOSPC: with on_error="warn" the run trained on and nothing
    ever reached the run directory."""
    root, base = str(tmp_path / "run"), small_tmpfs
    junk = os.path.join(base, "junk")
    with open(junk, "wb") as f:
        f.write(b"\0" * (3 << 20))  # 1 MB free: less than one checkpoint
    with warnings.catch_warnings(record=True) as caught, tg.CheckpointManager(
            root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), ram_tier=base, async_save=async_save,
            on_error="warn", handle_signals=False) as mgr:
        warnings.simplefilter("always")
        for step in (1, 2):
            mgr.save(step, {"model": _big(float(step))})
        mgr.wait()
        assert _steps(ram_dir(root, base)) == []
        os.remove(junk)  # room again: the next save goes to RAM
        mgr.save(3, {"model": _big(3.0)})
        mgr.wait()
        assert _steps(ram_dir(root, base)) == [3]
        mgr.ram.wait()
        # The first save's size is estimated from the state (no checkpoint yet): step 1 goes straight
        # to the run directory, sync and async. Before, the async step 1 tried RAM and failed (known
        # at step 2: steps [2, 3], one "failed" warning).
        assert _steps(root) == [1, 2, 3]
        assert [str(w.message) for w in caught if "failed" in str(w.message)] == []
    assert [e["step"] for e in _events(root, "ram_no_room")] == [1, 2]
    m = _big(0.0)
    with tg.CheckpointManager(root, handle_signals=False) as mgr:
        assert mgr.restore({"model": m}) == 3 and torch.all(m.weight == 3)
    for step in (1, 2):
        m = _big(0.0)
        tg.load(os.path.join(root, f"step-{step:09d}"), {"model": m})
        assert torch.all(m.weight == step)


def test_after_a_restart_the_size_restored_decides_the_first_save(tmp_path, small_tmpfs):
    """A restarted run knows the checkpoint's size from the step it restored: its first save does not
    try a RAM tier that has no room for it (and fail, raising with on_error="raise")."""
    root, base = str(tmp_path / "run"), small_tmpfs
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": _big(1.0)})
    with open(os.path.join(base, "junk"), "wb") as f:
        f.write(b"\0" * (3 << 20))
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        assert mgr.restore({"model": _big(0.0)}) == 1
        mgr.save(2, {"model": _big(2.0)})
    assert _steps(root) == [1, 2]
    assert [e["step"] for e in _events(root, "save_failed")] == []
    assert [e["step"] for e in _events(root, "ram_no_room")] == [2]


def _two_ranks_short_of_room(rank: int, world: int, root: str, base: str) -> list:
    """Sync saves of a replicated 1.2 MB model through a RAM tier with 1 MB free, then with room."""
    out = []
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), ram_tier=base,
                              handle_signals=False, timeout=30) as mgr:
        for step in (1, 2, 3):
            if step == 3 and rank == 0:
                os.remove(os.path.join(base, "junk"))
            h = mgr.save(step, {"model": _big(float(step))})
            out.append((step, h is not None, mgr.last_saved_step))
        mgr.ram.wait()
        out.append(_steps(ram_dir(root, base)) if rank == 0 else None)
    return out


def test_two_ranks_take_the_same_path_when_the_ram_tier_has_no_room(tmp_path, small_tmpfs):
    """With 2 gloo ranks: the rank that did not run out of room in RAM learns it from the save's
    failure record; both save the step again to the run directory (rank 0's decision, broadcast),
    then use the RAM tier again once it has room."""
    from dist_helper import run_ranks

    root, base = str(tmp_path / "run"), small_tmpfs
    with open(os.path.join(base, "junk"), "wb") as f:
        f.write(b"\0" * (3 << 20))
    res = [r.value for r in run_ranks(_two_ranks_short_of_room, 2, root, base, timeout=90)]
    assert res[0][:3] == res[1][:3] == [(1, True, 1), (2, True, 2), (3, True, 3)]
    assert res[0][3] == [3]  # step 3 went through RAM
    assert _steps(root) == [1, 2, 3]
    assert [e["step"] for e in _events(root, "ram_no_room")] == [1, 2]
    m = _big(0.0)
    tg.load(os.path.join(root, "step-000000001"), {"model": m})
    assert torch.all(m.weight == 1)


def test_a_kept_checkpoint_whose_manifest_cannot_be_read_is_kept_and_retention_goes_on(tmp_path, monkeypatch):
    """KeepBest reads the kept checkpoints' manifests at the first retention after a restart. An
    EIO reading one of them failed every later retention: nothing was deleted, the disk filled up.
    Now that checkpoint is kept (event ``retention_unreadable``) and the policy decides over the rest."""
    import errno

    from trainguard.storage import LocalStorage

    root = str(tmp_path / "run")
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", n=2), handle_signals=False) as mgr:
        for step, loss in [(1, 5.0), (2, 1.0), (3, 2.0)]:
            mgr.save(step, {"model": torch.nn.Linear(4, 2)}, metrics={"loss": loss})
    assert _steps(root) == [2, 3]
    read = LocalStorage.read_bytes

    def eio(self, path, *a, **k):
        if path.endswith(os.path.join("step-000000002", "manifest.json")):
            raise OSError(errno.EIO, "Input/output error", path)
        return read(self, path, *a, **k)

    monkeypatch.setattr(LocalStorage, "read_bytes", eio)
    with warnings.catch_warnings(record=True) as caught, tg.CheckpointManager(
            root, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", n=2), handle_signals=False) as mgr:
        warnings.simplefilter("always")
        for step, loss in [(4, 3.0), (5, 4.0), (6, 0.5)]:
            mgr.save(step, {"model": torch.nn.Linear(4, 2)}, metrics={"loss": loss})
    assert _steps(root) == [2, 3, 6]  # before: [2, 3, 4, 5, 6], every retention failed
    assert not [w for w in caught if "retention" in str(w.message)]
    assert {e["step"] for e in _events(root, "retention_unreadable")} == {2}
    assert _events(root, "retention_failed") == []


def test_ls_json_says_which_ram_copies_a_restart_discards(tmp_path):
    """``ls --json`` listed a RAM copy the next restore discards (``tiers.stale_reason``) as a plain
    ``"tier": "ram"`` row; only the table said "stale in RAM". Every row now has ``"stale"``."""
    import shutil

    from click.testing import CliRunner

    from test_keep17_review import _run
    from trainguard.cli import main

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    _run(root, base, None, {10: 10.0, 30: 30.0})
    shutil.rmtree(os.path.join(root, "step-000000030"))  # reached the run directory, deleted since: stale

    def rows() -> list[tuple]:
        r = CliRunner().invoke(main, ["ls", root, "--ram-tier", base, "--json"])
        assert r.exit_code == 0, r.output
        return [(x["tier"], x["step"], x["status"], x["stale"]) for x in json.loads(r.output)]

    assert rows() == [("durable", 10, "valid", None),
                      ("ram", 30, "valid", "it reached the run directory and was removed from it since")]
    _run(root, base, None, {20: 20.0}, persist=False)  # restores 10, discards 30; 20 is in RAM only
    assert rows() == [("durable", 10, "valid", None), ("ram", 20, "valid", None)]


def test_the_first_saves_estimate_counts_each_tensor_once() -> None:
    """ramsize.estimate: a module's parameters and buffers, an optimizer's state, plain tensors and
    a dict's, each tensor once (a tied weight, the same tensor in two entries)."""
    from trainguard.ramsize import estimate

    m = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100, bias=False), torch.nn.BatchNorm1d(100))
    m[1].weight = m[0].weight  # tied: 3,200 bytes once
    opt = torch.optim.Adam(m.parameters())
    m(torch.tensor([1, 2])).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq per parameter, and a step tensor each
    params = 100 * 8 * 4 + 2 * 100 * 4  # embedding (tied) + BatchNorm weight and bias
    buffers = 2 * 100 * 4 + 8  # running mean and var, num_batches_tracked
    adam = 2 * params + 3 * 4  # two moments + three float32 step tensors
    extra = torch.zeros(10)
    got = estimate({"model": m, "optim": opt, "x": extra, "d": {"x": extra, "y": torch.zeros(5, dtype=torch.int64)}, "n": 3})
    assert got == params + buffers + adam + 40 + 40
