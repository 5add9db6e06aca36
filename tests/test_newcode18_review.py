"""Review of the code that landed on 2 Dec (session newcode18): reproductions of what broke."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import trainguard as tg


def _requires_grad_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if "requires_grad" in str(w.message)]


def test_a_parameter_added_since_the_save_and_frozen_is_not_warned_about(tmp_path) -> None:
    """A strict=False resume into a model grown by a frozen layer (absent from the checkpoint):
    that layer had no requires_grad at save time, so nothing 'was trainable then'. A parameter
    the checkpoint holds and that was frozen since is still warned about."""
    m = nn.Sequential(nn.Linear(3, 3))
    tg.save(tmp_path / "c", {"model": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1)})

    grown = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    grown[1].requires_grad_(False)  # new since the save, frozen on purpose
    opt = torch.optim.SGD(grown[0].parameters(), lr=0.1)
    got = _requires_grad_warnings(lambda: tg.load(tmp_path / "c", {"model": grown, "opt": opt}, strict=False))
    assert got == []

    grown[0].weight.requires_grad_(False)  # held by the checkpoint, trainable then: warned
    got = _requires_grad_warnings(lambda: tg.load(tmp_path / "c", {"model": grown, "opt": opt}, strict=False))
    assert len(got) == 1 and "['0.weight']" in got[0] and "1.weight" not in got[0]
