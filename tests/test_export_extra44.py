"""``export``/``convert`` to ``.pt`` keep an entry's non-tensor values: a module's extra state
loads back with ``load_state_dict(strict=True)`` (before, a dict extra state became a lone tensor
``0._extra_state/t`` and an int one vanished), and an optimizer entry keeps its param_groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import trainguard as tg
from trainguard.convert import convert
from trainguard.export import export


class Counter(nn.Module):
    """A module whose extra state is a dict of an int, a string and a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.n, self.tag, self.hist = 0, "", torch.zeros(4)

    def get_extra_state(self) -> Any:
        return {"n": self.n, "tag": self.tag, "hist": self.hist}

    def set_extra_state(self, state: Any) -> None:
        self.n, self.tag, self.hist = state["n"], state["tag"], state["hist"].clone()


class Scalar(nn.Module):
    """A module whose extra state is a plain int (no tensor at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 0

    def get_extra_state(self) -> Any:
        return self.k

    def set_extra_state(self, state: Any) -> None:
        self.k = state


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Counter(), Scalar(), nn.Linear(3, 2))


@pytest.mark.parametrize("how", ["export", "convert"])
def test_pt_file_of_a_module_with_extra_state_loads_back_strictly(tmp_path: Path, how: str) -> None:
    src = _model(0)
    src[0].n, src[0].tag, src[0].hist = 7, "warm", torch.arange(4.0)
    src[1].k = 11
    tg.save(tmp_path / "c", {"model": src})
    out = tmp_path / "m.pt"
    if how == "export":
        export(tmp_path / "c", out)
    else:
        convert(tmp_path / "c", out)
    sd = torch.load(out, weights_only=True)
    dst = _model(1)
    assert dst[0].n != 7 and dst[1].k != 11 and not torch.equal(dst[2].weight, src[2].weight)
    dst.load_state_dict(sd, strict=True)
    assert (dst[0].n, dst[0].tag, dst[1].k) == (7, "warm", 11)
    assert torch.equal(dst[0].hist, torch.arange(4.0))
    for a, b in zip(src.state_dict().values(), dst.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


def test_pt_export_of_an_optimizer_entry_keeps_its_param_groups(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0123, weight_decay=0.3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tg.save(tmp_path / "c", {"model": model, "optim": opt})
    export(tmp_path / "c", tmp_path / "o.pt", entry="optim")
    sd = torch.load(tmp_path / "o.pt", weights_only=True)
    group = sd["param_groups"][0]
    assert (group["lr"], group["weight_decay"]) == (0.0123, 0.3)
    assert torch.equal(sd["state"]["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_safetensors_export_still_holds_tensors_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = _model(0)
    src[0].hist = torch.arange(4.0)
    tg.save(tmp_path / "c", {"model": src})
    export(tmp_path / "c", tmp_path / "m.safetensors")
    got = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(got) == ["0._extra_state/hist", "0.lin.bias", "0.lin.weight", "2.bias", "2.weight"]
    assert torch.equal(got["0._extra_state/hist"], torch.arange(4.0))


def test_a_bare_tensor_pt_file_imports_as_a_one_tensor_entry_and_exports_back(tmp_path: Path) -> None:
    """``torch.save(tensor)`` imported: entry ``model`` is that tensor, so ``{"model": t}`` loads it
    (before, the entry was a dict ``{"tensor": ...}`` that such a load refused as another structure)."""
    src = torch.arange(6.0).reshape(2, 3)
    torch.save(src, tmp_path / "t.pt")
    assert convert(tmp_path / "t.pt", tmp_path / "c")["tensors"] == 1
    dst = torch.zeros(2, 3)
    tg.load(tmp_path / "c", {"model": dst})
    assert torch.equal(dst, src)
    export(tmp_path / "c", tmp_path / "back.pt")
    assert torch.equal(torch.load(tmp_path / "back.pt", weights_only=True)["model"], src)
