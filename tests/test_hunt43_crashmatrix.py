"""Crash-matrix findings (hunt43, crashmatrix): injected faults that left what a real failure does not."""

from __future__ import annotations

import os

import torch

import trainguard as tg


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": tg.StateDict(t=torch.randn(1000, generator=g), seed=seed)}


def test_raise_at_before_persist_leaves_no_temp_dir_in_run_directory(tmp_path, monkeypatch):
    """TRAINGUARD_CRASH_AT=before_persist with KIND=raise (a failing disk in the RAM tier's copy to
    the run directory): the copy's temp directory is removed as for any failed copy. Before, the
    fault point sat between the temp directory's creation and the copy's try block, so the drill
    left ``step-N.tmp-<id>`` in the run directory for the rest of the run."""
    ram = tmp_path / "ram"
    ram.mkdir()
    root = tmp_path / "run"
    # on_error="warn": the next save goes on (with "raise" it raises the failed copy: test_hunt52_review52d.py)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=str(ram), on_error="warn") as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        mgr.ram.wait()
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_persist")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        mgr.save(2, _state(2))
        mgr.wait()
        mgr.ram.wait()
        left = [n for n in os.listdir(root) if ".tmp-" in n]
        assert left == [], left
        assert isinstance(mgr.ram._error, RuntimeError) and "before_persist" in str(mgr.ram._error)
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        mgr.save(3, _state(3))  # the next save copies its own step; nothing of step 2's failed copy stays
        mgr.wait()
        mgr.ram.wait()
        assert [n for n in os.listdir(root) if ".tmp-" in n] == []
        got = _state(0)
        assert mgr.restore(got) == 3
        assert torch.equal(got["w"]["t"], _state(3)["w"]["t"])
