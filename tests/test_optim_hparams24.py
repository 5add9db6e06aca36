"""A restore replaces the script's optimizer hyperparameters with the checkpoint's (torch's rule):
warned, with both values; an ordinary resume warns about nothing (session 24, ``optim_hparams.py``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR, StepLR

import trainguard as tg
from trainguard import OptimizerSettingsWarning


def _trained(opt_fn, sched_fn=None, steps: int = 5):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = opt_fn(m.parameters())
    sched = sched_fn(opt) if sched_fn else None
    for _ in range(steps):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return m, opt, sched


def _state(m, opt, sched):
    return {"model": m, "optim": opt, **({"sched": sched} if sched else {})}


def test_changed_weight_decay_and_betas_are_warned_and_the_checkpoints_are_used(tmp_path: Path) -> None:
    m, opt, _ = _trained(lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95)))
    tg.save(tmp_path / "c", _state(m, opt, None))
    m2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999))
    with pytest.warns(OptimizerSettingsWarning) as got:
        tg.load(tmp_path / "c", {"model": m2, "optim": opt2})
    msg = str(got[0].message)
    assert "group 0 weight_decay: the script set 0.05, the checkpoint has 0.1" in msg
    assert "group 0 betas: the script set (0.9, 0.999), the checkpoint has (0.9, 0.95)" in msg
    assert "lr" not in msg.split(":")[1]  # lr itself is never compared (a loop may set it every step)
    assert opt2.param_groups[0]["weight_decay"] == 0.1  # torch's rule: the checkpoint's value is in effect


def test_changed_learning_rate_under_a_scheduler_is_warned(tmp_path: Path) -> None:
    m, opt, sched = _trained(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda o: StepLR(o, 2, 0.5))
    tg.save(tmp_path / "c", _state(m, opt, sched))
    m2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.02, momentum=0.9)
    sched2 = StepLR(opt2, 2, 0.5)
    with pytest.warns(OptimizerSettingsWarning, match=r"group 0 initial_lr: the script set 0.02, the checkpoint has 0.1"):
        tg.load(tmp_path / "c", _state(m2, opt2, sched2))
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.025  # 0.1 halved twice: the checkpoint's


@pytest.mark.parametrize("kind", ["steplr", "onecycle", "manual lr", "plain"])
def test_an_ordinary_resume_warns_about_nothing(tmp_path: Path, kind: str) -> None:
    """The same script resumed: the scheduler (or the loop) moved lr, OneCycleLR cycled momentum;
    none of that is a change of the script's settings."""
    opt_fn = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4)  # noqa: E731
    sched_fn = {"steplr": lambda o: StepLR(o, 2, 0.5), "onecycle": lambda o: OneCycleLR(o, max_lr=1.0, total_steps=20),
                "manual lr": None, "plain": None}[kind]
    m, opt, sched = _trained(opt_fn, sched_fn)
    if kind == "manual lr":
        for g in opt.param_groups:  # what nanoGPT's loop does every iteration
            g["lr"] = 0.0123
    tg.save(tmp_path / "c", _state(m, opt, sched))
    m2 = torch.nn.Linear(4, 4)
    opt2 = opt_fn(m2.parameters())
    sched2 = sched_fn(opt2) if sched_fn else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.load(tmp_path / "c", _state(m2, opt2, sched2))
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_manager_restore_warns_on_every_rank_alike(tmp_path: Path) -> None:
    m, opt, _ = _trained(lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-8))
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(5, _state(m, opt, None))
    m2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3, eps=1e-6)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        with pytest.warns(OptimizerSettingsWarning, match=r"group 0 eps: the script set 1e-06, the checkpoint has 1e-08"):
            assert mgr.restore({"model": m2, "optim": opt2}) == 5
    assert opt2.param_groups[0]["eps"] == 1e-8


def _sequential(t_max: int, warmup: int):
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=warmup), CosineAnnealingLR(opt, T_max=t_max)],
                         milestones=[warmup])
    return {"model": m, "optim": opt, "sched": sched}


def test_a_changed_phase_of_a_sequential_scheduler_is_warned(tmp_path: Path) -> None:
    """SequentialLR keeps its milestones and chained schedulers in private/list attributes: a run
    extended from T_max=10 to 40 (warmup 5 -> 8) resumed with the old schedule and no word."""
    state = _sequential(10, 5)
    for _ in range(3):
        state["optim"].step()
        state["sched"].step()
    tg.save(tmp_path / "c", state)
    longer = _sequential(40, 8)
    with pytest.warns(UserWarning, match=r"_milestones=\[5\], _schedulers\[0\]\.total_iters=5, _schedulers\[1\]\.T_max=10, "
                      r"this run built it with _milestones=\[8\], _schedulers\[0\]\.total_iters=8, _schedulers\[1\]\.T_max=40"):
        tg.load(tmp_path / "c", longer)
    assert longer["sched"]._schedulers[1].T_max == 10  # torch's rule: the checkpoint's
    same = _sequential(10, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same schedule resumed: nothing to say
        tg.load(tmp_path / "c", same)
