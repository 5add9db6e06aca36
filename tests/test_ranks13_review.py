"""This session's single-process fixes replayed on 2 gloo ranks (DDP-style replicated state and
FSDP2 ``fully_shard`` state): every failure the same on every rank, within the timeout, and
the next save working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, full_state, run_ranks
from dist_helper import small_model as _model

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


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


def _capture_fails_on_rank_0(rank: int, world: int, root: str, managed: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(5))
    if rank == 1:
        model(torch.randn(2, 3))  # rank 0's stays uninitialized: its capture refuses it
    state = {"model": model}
    outcomes = []
    if managed:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, timeout=20) as mgr:
            for step in (1, 2, 3):
                outcomes.append(attempt(lambda s=step: mgr.save(s, state))["type"])
                model(torch.randn(2, 3))
            outcomes.append(attempt(mgr.wait)["type"])
    else:
        handles = []
        for step in (1, 2, 3):
            path = f"{root}/step-{step:09d}"
            outcomes.append(attempt(lambda p=path: handles.append(tg.save(p, state, async_=True, timeout=20)))["type"])
            model(torch.randn(2, 3))
        outcomes.append(attempt(lambda: handles[-1].result(timeout=30))["type"])
    return {"outcomes": outcomes, "committed": sorted(p.name for p in Path(root).glob("step-*") if "." not in p.name)}


@pytest.mark.parametrize("managed", [False, True])
def test_an_async_save_refused_in_one_ranks_capture_fails_at_the_same_call_on_every_rank(tmp_path, managed):
    # A rank whose capture refused the state (a lazy module still uninitialized there, rank 0's
    # set-aside of a rollback failing) raised in the save call, while the ranks that captured got
    # the same error from their save threads, in the handle: raised at their next save. Their
    # saves were then one call apart for good: each next save on one rank met the other rank's
    # following one and failed, and nothing was committed again (with a try/except around the
    # save, or a manager's next save raising the previous failure). Now every rank fails in its
    # handle: the next call raises on every rank, and the one after that commits.
    res = run_ranks(_capture_fails_on_rank_0, 2, str(tmp_path), managed, timeout=60, env=ENV)
    assert res[0].value["outcomes"] == res[1].value["outcomes"]
    first_error = "RankFailureError" if managed else "CheckpointError"
    assert res[0].value["outcomes"] == [None, first_error, None, None]
    assert res[0].value["committed"] == ["step-000000003"]
