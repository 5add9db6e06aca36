"""This session's single-process fixes replayed on 2 gloo ranks (DDP-style replicated state and
FSDP2 ``fully_shard`` state): every failure the same on every rank, within the timeout, and
the next save working."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, full_state, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 7))  # 7 rows: uneven over 2
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    return m


def _trained(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = _model(kind, 0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    torch.manual_seed(1)
    m(torch.randn(4, 16)).sum().backward()
    opt.step()
    return m, opt


def _refused_on_one_rank(rank: int, world: int, root: str, kind: str, case: str) -> dict:
    m, opt = _trained(kind)
    tg.save(f"{root}/c", {"model": m, "optim": opt})
    live = _model(kind, 3)
    if rank == 1 and case == "class":
        live_opt: torch.optim.Optimizer = torch.optim.SGD(live.parameters(), lr=1e-2, momentum=0.9)
    elif rank == 1 and case == "groups":
        ps = list(live.parameters())
        live_opt = torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
    else:
        live_opt = torch.optim.Adam(live.parameters(), lr=1e-2)
    no_state = torch.optim.SGD(live.parameters())  # full_state's collectives: the same on every rank
    before = full_state(live, no_state)
    outcome = attempt(lambda: tg.load(f"{root}/c", {"model": live, "optim": live_opt}))
    after = full_state(live, no_state)
    nxt = attempt(lambda: tg.save(f"{root}/d", {"model": live}))
    return {"outcome": outcome, "changed": [k for k in after if not torch.equal(after[k], before[k])], "next": nxt}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", ["class", "groups"])
def test_an_optimizer_refused_on_one_rank_leaves_every_ranks_state_untouched(tmp_path, kind, case):
    # The optimizer class and group checks refuse before anything is read into the state, but
    # only on the rank whose optimizer does not fit: the other ranks read the checkpoint into
    # their model and optimizer, then raised RankFailureError at the outcome round. The job's
    # replicas (DDP) or shards (FSDP2) then held two different models: rank 0 the checkpoint's,
    # rank 1 its own.
    res = run_ranks(_refused_on_one_rank, 2, str(tmp_path), kind, case, timeout=60, env=ENV)
    one, zero = res[1].value, res[0].value
    assert one["outcome"]["type"] == "CheckpointError"
    assert zero["outcome"]["type"] == "RankFailureError" and zero["outcome"]["ranks"] == [1]
    assert one["outcome"]["msg"] in zero["outcome"]["msg"]
    assert [r.value["changed"] for r in res] == [[], []]
    assert [r.value["next"] for r in res] == [{"type": None}] * 2
