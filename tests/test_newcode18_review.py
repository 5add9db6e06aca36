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


class _Wrapped(torch.optim.Optimizer):
    """Accelerate's ``AcceleratedOptimizer`` in short: the real optimizer in ``.optimizer``, its
    groups, state and ``state_dict()`` handed through (no ``averager`` of its own)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__, as Accelerate's
        self.optimizer = optimizer
        self.defaults = getattr(optimizer, "defaults", {})
        self.param_groups, self.state = optimizer.param_groups, optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):  # noqa: ANN001, ANN201
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def _wrapped_local_sgd_rank(rank: int, world: int, root: str) -> str:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    o = _Wrapped(PostLocalSGDOptimizer(torch.optim.AdamW(m.parameters(), lr=0.05), PeriodicModelAverager(period=2, warmup_steps=2)))
    for i in range(4):  # past the warm-up, each rank on its own batches: the replicas differ
        g = torch.Generator().manual_seed(10 * i + rank)
        o.zero_grad()
        m(torch.randn(5, 6, generator=g)).square().mean().backward()
        o.step()
    try:
        tg.save(f"{root}/step-4", {"model": m, "optim": o})
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


def test_local_sgd_inside_an_accelerate_like_wrapper_is_refused_too(tmp_path) -> None:
    """A PostLocalSGDOptimizer past its warm-up inside a wrapper that keeps it in ``.optimizer``
    (as ZeroRedundancyOptimizer's refusal already looks through): its ranks' parameters and
    moments differ, and the entries are not rank-local, so the save must be refused as without
    the wrapper (it saved one mix of the ranks' values, silently)."""
    from dist_helper import run_ranks

    res = run_ranks(_wrapped_local_sgd_rank, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r.ok, r.error
        assert "PostLocalSGDOptimizer past its averager's warm-up" in r.value and "['optim', 'model']" in r.value, r.value
