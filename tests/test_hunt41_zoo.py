"""Optimizers and schedulers the other zoos (test_optim_zoo_review.py, test_optimizers19_review.py) leave
out, torch 2.13's Muon and Adafactor among them: a resume from a checkpoint taken mid-run, into objects
built from other seeds, continues bit-identically (sync and async, the state mutated right after an
async save's call)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S
from torch.optim import swa_utils

import trainguard as tg


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _muon(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=1e-2)  # Muon takes matrices only


_ZOO = {
    "muon-chained": (_muon, lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, total_iters=3), S.ExponentialLR(o, 0.9)], optimizer=o)),
    "adafactor-linear": (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), lambda o: S.LinearLR(o, 0.1, total_iters=4)),
    "adadelta-multistep": (lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0, weight_decay=0.01), lambda o: S.MultiStepLR(o, [2, 5])),
    "adamax-cosine": (lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2), lambda o: S.CosineAnnealingLR(o, 7)),
    "rmsprop-centered-step": (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, centered=True, momentum=0.5),
                              lambda o: S.StepLR(o, 2)),
    "rprop-poly": (lambda m: torch.optim.Rprop(m.parameters(), lr=1e-2), lambda o: S.PolynomialLR(o, 8)),
    "adamw-maximize-triangular2": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, maximize=True, foreach=False),
                                   lambda o: S.CyclicLR(o, 1e-3, 1e-1, step_size_up=2, mode="triangular2")),
    "sgd-swalr-ema": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                      lambda o: swa_utils.SWALR(o, swa_lr=0.05, anneal_epochs=3)),
}


def _state(name: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = _Net()
    make_opt, make_sched = _ZOO[name]
    opt = make_opt(model)
    st = {"model": model, "optim": opt, "sched": make_sched(opt), "rng": tg.RNGState()}
    if name.endswith("ema"):
        st["ema"] = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    return st


def _step(st: dict) -> None:
    st["optim"].zero_grad()
    st["model"](torch.randn(5, 6)).square().mean().backward()
    st["optim"].step()
    st["sched"].step()
    if "ema" in st:
        st["ema"].update_parameters(st["model"])


def _same(a: object, b: object, path: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif not callable(a):
        assert a == b or (a != a and b != b), (path, a, b)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(_ZOO))
def test_resume_is_bit_identical_for_the_optimizers_and_schedulers_the_other_zoos_leave_out(tmp_path, name, async_):
    ref = _state(name, 0)
    for _ in range(10):
        _step(ref)
    run = _state(name, 0)
    for _ in range(5):
        _step(run)
    handle = tg.save(tmp_path / "step-5", run, async_=async_)
    if async_:
        _step(run)  # the step after the call: the checkpoint must hold step 5's state
        handle.result(60)
    new = _state(name, 1)  # other weights and RNG: everything must come from the checkpoint
    before = [p.clone() for p in new["model"].parameters()]
    tg.load(tmp_path / "step-5", new)
    assert any(not torch.equal(a, p) for a, p in zip(before, new["model"].parameters()))
    for _ in range(5):
        _step(new)
    for key in ("model", "optim", "sched", "ema"):
        if key in ref:
            _same(ref[key].state_dict(), new[key].state_dict(), key)
