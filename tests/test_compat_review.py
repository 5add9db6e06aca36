"""Upgrading trainguard mid-run: a run directory written by an old version (tests/data/compat_*,
made by tests/data/make_compat_*.py at the commit it names) restores bit for bit with this one,
verifies, and keeps saving with its retention."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

import trainguard as tg
from trainguard.inspect import verify

DATA = Path(__file__).parent / "data"


def _maker():
    spec = importlib.util.spec_from_file_location("make_compat_bc81a74", DATA / "make_compat_bc81a74.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_of_the_first_core_engine_restores_bit_for_bit_and_keeps_saving(tmp_path):
    mk = _maker()
    root = tmp_path / "run"
    shutil.copytree(DATA / "compat_bc81a74", root, ignore=shutil.ignore_patterns("expected.pt"))
    expected = torch.load(DATA / "compat_bc81a74" / "expected.pt", weights_only=True)
    state = mk.build()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(2), keep=tg.KeepLatest(2)) as mgr:
        assert mgr.restore(state) == 4
        got = mk.snapshot(state)
        assert set(got) == set(expected)
        for k, v in expected.items():
            if isinstance(v, dict):
                assert set(got[k]) == set(v), k
                assert all(torch.equal(got[k][n], t) for n, t in v.items()), k
            elif isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v), k
            else:
                assert got[k] == v, k
        for step in range(5, 9):
            mk.train_step(state, step)
            mgr.save(step, state)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000006", "step-000000008"]
    assert all(verify(str(p)).ok for p in root.glob("step-*"))
