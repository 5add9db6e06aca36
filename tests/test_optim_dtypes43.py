"""Resuming keeps the dtype of an optimizer's 0-dim state (session 43).

torch's ``Optimizer.load_state_dict`` casts every floating state tensor but ``step`` to its
parameter's dtype. NAdam's ``mu_product`` and ASGD's ``eta``/``mu`` are created in float32 whatever
the parameters are, so with float64 (or bfloat16) parameters a resumed run held them in float64
(bfloat16) and went on with other numbers than the run that was not interrupted: NAdam's float64
weights differed after 25 more steps. The load puts the saved dtype back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg


def _train(m: torch.nn.Module, o: torch.optim.Optimizer, steps: range, dtype: torch.dtype) -> None:
    for i in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i)).to(dtype)
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()


def _built(cls: Any, dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3).to(dtype)
    return m, cls(m.parameters(), lr=0.01)


def _dtypes(o: torch.optim.Optimizer) -> list[dict[str, torch.dtype]]:
    return [{k: v.dtype for k, v in o.state[p].items()} for g in o.param_groups for p in g["params"]]


@pytest.mark.parametrize("cls", [torch.optim.NAdam, torch.optim.ASGD])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("form", ["optimizer", "torch_state_dict"])
def test_resume_keeps_the_state_dtypes_and_the_numbers(tmp_path: Path, cls: Any, dtype: torch.dtype, form: str) -> None:
    m, o = _built(cls, dtype, 0)
    _train(m, o, range(5), dtype)
    # "torch_state_dict": the optimizer saved in torch's own form (keyed by index), loaded into an optimizer
    tg.save(tmp_path / "c", {"m": m, "o": o if form == "optimizer" else o.state_dict()})
    saved_dtypes = _dtypes(o)
    assert any(t == torch.float32 for d in saved_dtypes for k, t in d.items() if k != "step")  # the case at hand
    _train(m, o, range(5, 30), dtype)  # the run that goes on

    m2, o2 = _built(cls, dtype, 1)
    tg.load(tmp_path / "c", {"m": m2, "o": o2})
    assert _dtypes(o2) == saved_dtypes
    _train(m2, o2, range(5, 30), dtype)
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)


def test_state_following_the_parameters_still_does(tmp_path: Path) -> None:
    """Adam's moments into bfloat16 parameters from a float32 checkpoint: cast, as torch does."""
    m, o = _built(torch.optim.Adam, torch.float32, 0)
    _train(m, o, range(3), torch.float32)
    tg.save(tmp_path / "c", {"m": m, "o": o})
    m2, o2 = _built(torch.optim.Adam, torch.bfloat16, 1)
    tg.load(tmp_path / "c", {"m": m2, "o": o2}, strict=False)
    assert {k: t for d in _dtypes(o2) for k, t in d.items()} == {"step": torch.float32, "exp_avg": torch.bfloat16,
                                                                 "exp_avg_sq": torch.bfloat16}
