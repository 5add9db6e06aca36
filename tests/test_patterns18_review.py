"""Model- and optimizer-building patterns of real training code across a save and a resume
(session 18's review): what the optimizer's ``state_dict()`` holds besides its ``state`` and
``param_groups``, and optimizers whose state trainguard cannot save."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import trainguard as tg


def _local_sgd(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    avg = PeriodicModelAverager(period=2, warmup_steps=4)
    return m, PostLocalSGDOptimizer(torch.optim.AdamW(m.parameters(), lr=0.05), avg)


def _local_sgd_step(m: nn.Module, o: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(100 + i)  # the same batch on both ranks: the replicas stay equal
    loss = m(torch.randn(5, 6, generator=g)).square().mean()
    o.zero_grad()
    loss.backward()
    o.step()
    return loss.item()


def _local_sgd_rank(rank: int, world: int, root: str) -> tuple[int, int, list[str], bool]:
    m, o = _local_sgd(0)
    for i in range(3):
        _local_sgd_step(m, o, i)
    tg.save(f"{root}/step-3", {"model": m, "optim": o})
    m2, o2 = _local_sgd(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tg.load(f"{root}/step-3", {"model": m2, "optim": o2})
    steps = (o.averager.step, o2.averager.step)
    same = [_local_sgd_step(m, o, i) for i in range(3, 6)] == [_local_sgd_step(m2, o2, i) for i in range(3, 6)]
    return *steps, [str(w.message) for w in caught], same and o.averager.step == o2.averager.step


def test_post_local_sgd_optimizer_keeps_its_averager_step(tmp_path) -> None:
    """``PostLocalSGDOptimizer.state_dict()`` adds the model averager's ``step`` beside ``state``
    and ``param_groups``; the optimizer entry kept only those two, so a resumed run's averager
    started again at step 0 (torch warned "does not contain a step counter for an averager") and
    went through its warm-up again: parameters averaged at other steps than without the restart."""
    from dist_helper import run_ranks

    res = run_ranks(_local_sgd_rank, 2, str(tmp_path), timeout=60)
    for r in res:
        saved, loaded, caught, same = r.value
        assert (saved, loaded) == (3, 3), r.value
        assert not any("step counter" in w for w in caught), caught
        assert same
