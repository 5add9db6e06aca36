"""Session 46's hunt for the fixed cost of a save and of a resume (small states saved often): what a
save does to the file system must not grow with the number of checkpoints the run directory keeps.

The calls are counted by wrapping ``os`` functions (each wrapper calls the real one): real saves,
real files, no stub."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg


def _state() -> dict[str, Any]:
    return {"w": torch.arange(64.0), "progress": tg.StateDict(step=0)}


class _Calls:
    """``os.stat`` of a step's manifest and ``os.listdir``/``os.scandir`` of ``root``, counted while on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root, self.on, self.n = str(root), False, Counter()
        for name in ("stat", "listdir", "scandir"):
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def wrapped(path: Any = ".", *a: Any, **kw: Any) -> Any:
            p = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
            if self.on and name == "stat" and p.startswith(self.root) and p.endswith("manifest.json"):
                self.n["manifest_stat"] += 1
            if self.on and name != "stat" and p.rstrip("/") == self.root:
                self.n["root_listing"] += 1
            return real(path, *a, **kw)
        return wrapped

    def during(self, fn: Any) -> Counter:
        self.n.clear()
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return Counter(self.n)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_saves_file_system_calls_do_not_grow_with_the_checkpoints_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    """Retention stat'ed every kept checkpoint's manifest at every save (``commit.list_steps``): with
    ``KeepAll`` (or ``KeepEvery``) the save of the N-th step made N stats, O(N^2) over a run, on the
    training thread of a sync save (500 kept: 532 ``os.stat`` calls a save, 8 now; one round trip each on NFS).
    Now a manifest is stat'ed the first time retention lists its step, so a save costs the same
    number of calls with 5 or 40 checkpoints kept."""
    root = tmp_path / "run"
    calls = _Calls(monkeypatch, root)
    state = _state()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=async_save,
                              handle_signals=False) as mgr:
        def save(step: int) -> None:
            state["progress"]["step"] = step
            assert mgr.save(step, state) is not None
            mgr.wait()

        for step in range(1, 5):
            save(step)
        few = calls.during(lambda: save(5))
        for step in range(6, 40):
            save(step)
        many = calls.during(lambda: save(40))
    assert sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) == list(range(1, 41))
    assert many == few, (few, many)
    assert few["manifest_stat"] <= 2 and few["root_listing"] <= 2, few


def test_retention_after_restore_sees_a_manifest_removed_since_it_was_last_listed(tmp_path: Path) -> None:
    """What retention remembers of the manifests it saw is dropped by ``restore``: a checkpoint whose
    manifest went away (by hand, a bad disk) is not counted among those kept after it. Here
    ``KeepLatest(2)`` keeps steps 2 and 3; step 3's manifest is removed; restore returns 2; the save
    of step 4 must keep 2 (counting step 3 as a checkpoint would delete 2, the only older good one)."""
    root = tmp_path / "run"
    state = _state()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in (1, 2, 3):
            state["progress"]["step"] = step
            mgr.save(step, state)
        assert sorted(p.name for p in root.glob("step-*")) == ["step-000000002", "step-000000003"]
        (root / "step-000000003" / "manifest.json").unlink()
        assert mgr.restore(state) == 2
        state["progress"]["step"] = 4
        assert mgr.save(4, state) is not None
    assert (root / "step-000000002" / "manifest.json").exists()
    assert (root / "step-000000004" / "manifest.json").exists()
