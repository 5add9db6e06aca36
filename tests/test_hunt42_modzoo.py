"""Module kinds whose ``_load_from_state_dict`` reads the format version that ``state_dict()``
records in ``_metadata`` (session 42's module zoo): ``tg.load`` hands the values to
``load_state_dict`` with the module's own versions, as a ``state_dict()`` kept by ``torch.save``
does, so such a module takes them as current, not as a pre-version checkpoint to "upgrade"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.ao.quantization import MinMaxObserver

import trainguard as tg


def _observed() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), MinMaxObserver(eps=1e-3))


def test_a_quantization_observer_keeps_its_eps_and_scale_as_torch_load_state_dict_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _observed()
    saved(torch.randn(8, 4) * 1e-5)  # a range so small that eps decides the scale
    path = tmp_path / "step-000000001"
    tg.save(path, {"model": saved})
    by_torch, by_tg = _observed(), _observed()
    by_torch.load_state_dict(saved.state_dict())
    tg.load(path, {"model": by_tg})
    # the observer's eps went to float32's (1.19e-07) with the version missing: the scale with it
    assert torch.equal(by_tg[1].eps, saved[1].eps) and torch.equal(by_torch[1].eps, saved[1].eps)
    assert torch.equal(by_tg[1].calculate_qparams()[0], saved[1].calculate_qparams()[0])


class _Versioned(nn.Module):
    """A module whose format changed: version 1 stored ``log_scale``, version 2 stores ``scale``, and
    a state without a version (before version 1) held the scale squared."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 3.0))

    def _load_from_state_dict(self, sd: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any) -> None:
        if local_metadata.get("version") is None and prefix + "scale" in sd:
            sd[prefix + "scale"] = sd[prefix + "scale"].sqrt()
        super()._load_from_state_dict(sd, prefix, local_metadata, *args)


def test_a_versioned_module_of_the_saving_code_is_not_upgraded_on_resume(tmp_path: Path) -> None:
    model = nn.Sequential(_Versioned())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "step-000000002"
    tg.save(path, {"model": model, "optim": optim})
    fresh = nn.Sequential(_Versioned())
    with torch.no_grad():
        fresh[0].scale.fill_(5.0)
    tg.load(path, {"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    assert torch.equal(fresh[0].scale, model[0].scale), fresh[0].scale  # not sqrt(3)
