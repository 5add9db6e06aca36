"""Model- and optimizer-building patterns of real training code across a save and a resume
(session 18's review): what the optimizer's ``state_dict()`` holds besides its ``state`` and
``param_groups``, and optimizers whose state trainguard cannot save."""

from __future__ import annotations

import warnings

import pytest
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


def _zero_rank(rank: int, world: int, root: str) -> tuple[str, str, bool, bool]:
    import os

    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(seed: int, zero: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        if zero:
            return m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
        return m, torch.optim.AdamW(m.parameters(), lr=0.05)

    m, o = build(0, zero=True)
    _local_sgd_step(m, o, 0)
    with pytest.raises(tg.CheckpointError) as saving:
        tg.save(f"{root}/step-1", {"model": m, "optim": o})
    m1, o1 = build(0, zero=False)
    _local_sgd_step(m1, o1, 0)
    tg.save(f"{root}/plain", {"model": m1, "optim": o1})
    before = [p.clone() for p in m.parameters()]
    with pytest.raises(tg.CheckpointError) as loading:
        tg.load(f"{root}/plain", {"model": m, "optim": o})
    untouched = all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    return str(saving.value), str(loading.value), untouched, os.path.exists(f"{root}/step-1")


def _local_phase_rank(rank: int, world: int, root: str) -> tuple[str, bool]:
    """Past the averager's warm-up (2 steps) each rank trains on its own batches, as under DDP's
    post_localSGD_hook: the replicas differ between averagings (every 2 steps)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    def build(seed: int, local: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        o = PostLocalSGDOptimizer(torch.optim.AdamW(m.parameters(), lr=0.05), PeriodicModelAverager(period=2, warmup_steps=2))
        if local:
            m.trainguard_rank_local = o.trainguard_rank_local = True
        return m, o

    m, o = build(0, local=False)
    for i in range(4):
        _local_sgd_step(m, o, 10 * i + rank)
    with pytest.raises(tg.CheckpointError) as refused:
        tg.save(f"{root}/mixed", {"model": m, "optim": o})
    m.trainguard_rank_local = o.trainguard_rank_local = True  # what the message says to do
    tg.save(f"{root}/step-4", {"model": m, "optim": o})
    m2, o2 = build(7, local=True)
    tg.load(f"{root}/step-4", {"model": m2, "optim": o2})
    want = [_local_sgd_step(m, o, 10 * i + rank) for i in range(4, 7)]
    return str(refused.value), want == [_local_sgd_step(m2, o2, 10 * i + rank) for i in range(4, 7)]


def test_local_sgd_past_warm_up_is_refused_unless_its_entries_are_rank_local(tmp_path) -> None:
    """After the warm-up a PostLocalSGDOptimizer's ranks hold different parameters and moments,
    while a model or optimizer entry is saved once for all ranks, each tensor from one of them:
    every rank resumed with the same mix of the ranks' values, and its next losses differed from
    the run's without a restart, silently. Refused, naming both entries; marked rank-local,
    each rank resumes its own state bit for bit."""
    from dist_helper import run_ranks

    res = run_ranks(_local_phase_rank, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r.ok, r.error
        refused, same = r.value
        assert "PostLocalSGDOptimizer past its averager's warm-up" in refused and "['optim', 'model']" in refused, refused
        assert same


def test_zero_redundancy_optimizer_is_refused_saying_what_to_use(tmp_path) -> None:
    """``ZeroRedundancyOptimizer.state_dict()`` raises on a rank that did not gather the state with
    ``consolidate_state_dict(to=...)``, which gathers it on one rank only: a save failed on every
    rank with torch's "Optimizer state has not been consolidated on this rank. Please call
    `consolidate_state_dict(to=1)`", which no call order fixes, and a load the same way from
    inside the loader. Both are refused before anything is written or read, naming the entry and
    what shards optimizer state in a way trainguard saves (FSDP2)."""
    from dist_helper import run_ranks

    res = run_ranks(_zero_rank, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r.ok, r.error
        saving, loading, untouched, committed = r.value
        for msg in (saving, loading):
            assert "entry 'optim'" in msg and "ZeroRedundancyOptimizer" in msg and "fully_shard" in msg, msg
        assert "saves every rank's state" in saving and "cannot load it" in loading
        assert untouched and not committed


def test_param_names_name_the_current_parameters_after_activation_checkpointing_was_toggled(tmp_path) -> None:
    """An optimizer built from ``named_parameters()`` keeps ``param_names`` in its groups. Saved
    with ``checkpoint_wrapper`` on a layer and resumed without it, the load put the saved names
    (``0._checkpoint_wrapped_module.weight``) into the resumed optimizer, which names no parameter of
    its model (``dict(model.named_parameters())[name]`` raised KeyError), and every later
    checkpoint kept them. The optimizer's own names stay; the order follows its parameters."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build(wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        if wrap:
            m[0] = checkpoint_wrapper(m[0])
        return m, torch.optim.AdamW(m.named_parameters(), lr=0.05)

    for saved, resumed in ((True, False), (False, True)):
        m, o = build(saved)
        _local_sgd_step(m, o, 0)
        tg.save(tmp_path / f"{saved}", {"model": m, "optim": o})
        m2, o2 = build(resumed)
        params = dict(m2.named_parameters())
        o2.param_groups[0]["params"].reverse()  # another order than at save time
        o2.param_groups[0]["param_names"].reverse()
        tg.load(tmp_path / f"{saved}", {"model": m2, "optim": o2})
        group = o2.param_groups[0]
        assert [params[n] for n in group["param_names"]] == group["params"]
        assert all(int(o2.state[p]["step"]) == 1 for p in group["params"])
