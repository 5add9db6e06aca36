"""A DCP checkpoint saved with ``DefaultSavePlanner(flatten_state_dict=False)`` pickles each top-level
value whole (the model's state_dict, the optimizer's) instead of writing its tensors as DCP tensors.
``trainguard convert`` refused it with "the DCP checkpoint holds no tensors", although the tensors are
inside those pickles and ``torch.load(weights_only=True)`` reads them. Now it is imported, bit for bit;
a DCP whose values hold no tensor at all is still refused, naming what it skipped."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import trainguard as tg
from trainguard import CheckpointError
from trainguard.convert import convert


def _save_unflat(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)


def test_an_unflattened_dcp_imports_model_and_optimizer_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    _save_unflat({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, tmp_path / "dcp")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000007")

    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh[0].weight, model[0].weight)
    state = {"model": fresh, "optim": fresh_opt, "step": 0}
    tg.load(tmp_path / "ck" / "step-000000007", state)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    for p_new, p_old in zip(fresh.parameters(), model.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.state[p_new][k], opt.state[p_old][k])
    assert state["step"] == 7


def test_an_unflattened_dcp_without_tensors_is_still_refused(tmp_path: Path) -> None:
    _save_unflat({"meta": {"epoch": 3, "name": "run"}, "step": 7}, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="holds no tensors"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000007")
    assert not (tmp_path / "ck" / "step-000000007").exists()
