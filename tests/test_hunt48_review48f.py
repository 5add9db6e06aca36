"""Session 48, review48f: sharding-specific modules on real gloo ranks (127.0.0.1).

An FSDP1 optimizer's entries of ``optimizer.state`` that are no parameter's (a custom optimizer's
own counter, ``self.state["global_step"] = n``, as Sophia-style optimizers keep) were saved (in
``state``, beside the parameters' names) but dropped by the load: torch's
``set_optimizer_state_dict`` leaves out a key it cannot map to a parameter (torch 2.13), so the
resumed optimizer had no ``global_step`` at all (any strategy, both ``use_orig_params``). They are
now saved under ``state_by_key``, as ``stateful.OptimizerAdapter`` saves a plain optimizer's, and
put back after ``set_optimizer_state_dict``; such a checkpoint loads into a plain model's
optimizer too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import run_ranks


class CountedAdam(torch.optim.Adam):
    """Adam that keeps its own step counter in ``self.state`` under a key that is no parameter."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        out = super().step(closure)
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        return out


def _own_counter(rank: int, world: int, root: str, strategy: str, uop: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    m = FSDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)), use_orig_params=uop,
             sharding_strategy=getattr(ShardingStrategy, strategy), device_id=torch.device("cpu"))
    o = CountedAdam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        o.zero_grad()
        m(torch.randn(4, 8, generator=g)).sum().backward()
        o.step()
    tg.save(f"{root}/ck", {"model": m, "optim": o})
    o.state["global_step"] = 99
    tg.load(f"{root}/ck", {"model": m, "optim": o})
    fsdp1 = o.state.get("global_step")
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    po = CountedAdam(plain.parameters(), lr=1e-2)
    tg.load(f"{root}/ck", {"model": plain, "optim": po})
    return {"fsdp1": fsdp1, "plain": po.state.get("global_step"),
            "moments": sum(1 for p in plain.parameters() if "exp_avg" in po.state.get(p, {}))}


@pytest.mark.parametrize("strategy,uop", [("FULL_SHARD", False), ("FULL_SHARD", True), ("NO_SHARD", False)])
def test_fsdp1_optimizer_state_keyed_by_no_parameter_survives_a_resume(tmp_path: Path, strategy: str, uop: bool) -> None:
    """Before: ``global_step`` was None after the load (dropped by set_optimizer_state_dict)."""
    for r in run_ranks(_own_counter, 2, str(tmp_path), strategy, uop, timeout=120):
        assert r.value == {"fsdp1": 3, "plain": 3, "moments": 4}, (r.rank, r.value)


def _dict_order(rank: int, world: int, root: str) -> dict:
    import warnings

    from trainguard.sharedvalues import SharedValuesDifferWarning

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]  # under torchrun, {t: 0 for t in set(tokens)} orders them per process
    order = tokens if rank == 0 else tokens[::-1]
    out = {}
    for name, counts in (("same", {t: len(t) for t in order}), ("other", {t: len(t) + rank for t in order})):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            tg.save(f"{root}/{name}", {"counts": counts, "step": tg.StateDict(step=3)})
        out[name] = [str(x.message) for x in w if issubclass(x.category, SharedValuesDifferWarning)]
    back = {"counts": {t: 0 for t in order}, "step": tg.StateDict(step=0)}
    tg.load(f"{root}/same", back)  # a plain dict entry is replaced by the saved one
    out["back"] = back["counts"] == {t: len(t) for t in tokens}
    return out


def test_equal_dicts_filled_in_another_order_on_each_rank_are_not_warned_as_differing(tmp_path: Path) -> None:
    """Before: rank 0 warned SharedValuesDifferWarning for 'counts' (json.dumps kept each rank's key
    order). A dict whose values differ is still warned."""
    res = run_ranks(_dict_order, 2, str(tmp_path), timeout=60)
    assert res[0].value["same"] == [], res[0].value["same"]
    assert len(res[0].value["other"]) == 1 and "'counts'" in res[0].value["other"][0]
    assert all(r.value["back"] for r in res)
