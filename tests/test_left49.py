"""Session 49's own fixes, from the helpers' lists of what they saw and left."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainguard as tg


def _sched(gamma: float) -> torch.optim.lr_scheduler.StepLR:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, 3, gamma=gamma)


@pytest.mark.parametrize(("saved", "built", "warned"), [
    (float("nan"), 0.5, True),  # skipped before: the skeleton holds {"$float": "nan"}, not a plain value
    (float("inf"), 0.5, True),
    (float("nan"), float("nan"), False),  # the same NaN is no change
    (0.5, 0.5, False),
    (0.5, 0.25, True),
])
def test_a_schedulers_non_finite_setting_is_compared_on_load(tmp_path, saved, built, warned):
    tg.save(str(tmp_path / "c"), {"sched": _sched(saved)})
    sched = _sched(built)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.load(str(tmp_path / "c"), {"sched": sched})
    said = [str(x.message) for x in w if "gamma" in str(x.message)]
    assert bool(said) is warned, said
    if warned:
        assert f"gamma={saved!r}" in said[0] and f"gamma={built!r}" in said[0], said[0]
    assert sched.gamma == saved or (saved != saved and sched.gamma != sched.gamma)  # the checkpoint's is taken
