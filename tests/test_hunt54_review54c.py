"""Hunt 54 (review54c): a hostile review of session 53's DCP import of unflattened checkpoints,
doctor's own-generator report and RankFailureError's readable text."""

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


def _save_unflat(state: dict, path: Path, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), planner=DefaultSavePlanner(flatten_state_dict=False), **kw)


def _convert(src: Path, dst: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(src, dst)


def test_unflattened_dcp_of_parameters_imports_them(tmp_path: Path) -> None:
    """``model.state_dict(keep_vars=True)`` (or ``dict(model.named_parameters())``) saved unflattened:
    its pickle holds ``nn.Parameter``s. The whole entry was skipped (the checkpoint refused as
    "holds no tensors that trainguard can read"), as if a Parameter were no tensor."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    _save_unflat({"model": model.state_dict(keep_vars=True), "step": 3}, tmp_path / "dcp", no_dist=True)
    res = _convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000003")
    assert res["skipped"] == []
    fresh = torch.nn.Linear(4, 3)
    state = {"model": fresh, "step": 0}
    tg.load(tmp_path / "ck" / "step-000000003", state)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert state["step"] == 3


def _fsdp_unflat_save(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dist_helper import small_model

    m = small_model("fsdp", 0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    # a plain tensor beside the DTensors: the import had something to write, and dropped the model
    dcp.save({"model": msd, "scale": torch.tensor(2.0)}, checkpoint_id=path,
             planner=DefaultSavePlanner(flatten_state_dict=False))


def test_unflattened_dcp_of_dtensors_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    """2 gloo ranks save an FSDP2 model's DTensors with ``flatten_state_dict=False``: DCP pickles the
    entry whole, one rank's copy (its shards only). The import wrote a checkpoint of ``scale``
    alone, exit 0, the model listed among "entries that are neither tensors nor JSON values".
    Now it is refused, naming the key and the planner to save with."""
    from dist_helper import run_ranks

    run_ranks(_fsdp_unflat_save, 2, str(tmp_path / "dcp"), timeout=120)
    with pytest.raises(CheckpointError) as ei:
        _convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000001")
    msg = str(ei.value)
    assert "'model'" in msg and "DTensor" in msg and "flatten_state_dict" in msg, msg
    assert not (tmp_path / "ck" / "step-000000001").exists()
