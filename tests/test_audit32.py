"""Findings of session 32's audit, each with the behaviour that was wrong before."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import trainguard as tg


def test_unnamed_optimizer_param_warns_once_per_load(tmp_path: Path) -> None:
    """A parameter of the optimizer in no module of the state is keyed by index, with a warning;
    a load gave that warning twice (once from reading the current state, once from matching the
    groups)."""
    m = torch.nn.Linear(2, 2)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([*m.parameters(), extra])
    m(torch.ones(1, 2)).sum().backward()
    extra.grad = torch.ones(3)
    opt.step()
    with warnings.catch_warnings(record=True) as saved:
        warnings.simplefilter("always")
        tg.save(tmp_path / "c", {"model": m, "optim": opt})
    saved_extra = extra.detach().clone()
    with torch.no_grad():
        extra.add_(1)
    with warnings.catch_warnings(record=True) as loaded:
        warnings.simplefilter("always")
        tg.load(tmp_path / "c", {"model": m, "optim": opt})
    ours = [w for w in loaded if "belong to no nn.Module" in str(w.message)]
    assert len([w for w in saved if "belong to no nn.Module" in str(w.message)]) == 1
    assert len(ours) == 1, [str(w.message) for w in loaded]
    assert torch.equal(opt.state[extra]["exp_avg"], torch.full((3,), 0.1))  # loaded by index
    assert not torch.equal(extra, saved_extra)  # not an entry of the state: left as it is
