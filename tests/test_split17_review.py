"""Review of ``split_state=True`` against what pipeline/expert-parallel jobs do (docs/distributed.md,
"Pipeline stages and experts"): PP x FSDP2 on a pp x dp mesh, other splits and the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from test_split_state import N_LAYERS, full_model, stage, train_step  # the same stages as the feature's tests

from dist_helper import run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _pp_fsdp(rank: int, world: int, root: str, pp: int, save: bool, async_: bool) -> dict[str, torch.Tensor]:
    """``pp`` stages, each stage's layers ``fully_shard``ed over its ``mesh["dp"]`` (torchtitan's layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    per = N_LAYERS // pp
    s = rank // dp
    m = stage(list(range(s * per, (s + 1) * per)))
    for layer in m.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    state = {"model": m, "optim": opt}
    if save:
        for k in range(2):
            train_step(m, opt, k)
        h = tg.save(f"{root}/step-000000002", state, split_state=True, async_=async_)
        if async_:
            h.result()
    else:
        tg.load(f"{root}/step-000000002", state, split_state=True)
    train_step(m, opt, 2)
    return {n: _whole(p) for n, p in m.named_parameters()}


def _reference() -> dict[str, torch.Tensor]:
    m = full_model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    for k in range(3):
        train_step(m, opt, k)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _union(results: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r.value)
    return out


@pytest.mark.parametrize("async_", [False, pytest.param(True, marks=pytest.mark.slow)])  # suite time: async in the slow run
def test_pp_by_fsdp2_on_dp_submeshes_saves_and_reloads(tmp_path, async_):
    """Stage 1's ranks have pp coordinate 1: the mesh-slice rule took them for replicas of stage
    0 and wrote none of their DTensors (the save failed 'the ranks wrote 0 elements of its 36')."""
    ref = _reference()
    saved = run_ranks(_pp_fsdp, 4, str(tmp_path), 2, True, async_, timeout=120, env=ENV)
    assert _union(saved).keys() == ref.keys()
    if not async_:  # one rank per stage (FSDP over 1 rank) continues bit for bit (4 ranks x 2 stages held up too)
        got = _union(run_ranks(_pp_fsdp, 2, str(tmp_path), 2, False, False, timeout=120, env=ENV))
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    # The whole model and one AdamW on one process, with no flag.
    m = full_model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    tg.load(tmp_path / "step-000000002", {"model": m, "optim": opt})
    train_step(m, opt, 2)
    assert all(torch.equal(p.detach(), ref[n]) for n, p in m.named_parameters())


N_EXPERTS = 4


def moe(experts: list[int]) -> nn.Module:
    """A shared block every rank holds and the experts ``experts`` (expert parallelism)."""
    torch.manual_seed(0)
    m = nn.Module()
    m.shared = nn.Linear(6, 6)
    m.experts = nn.ModuleDict({str(e): nn.Linear(6, 6) for e in range(N_EXPERTS)})
    for e in range(N_EXPERTS):
        if e not in experts:
            del m.experts[str(e)]
    return m


def moe_step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    for name, ex in m.experts.items():
        g = torch.Generator().manual_seed(seed * 100 + int(name))
        ex(torch.randn(3, 6, generator=g)).pow(2).sum().backward()
    for p in m.shared.parameters():  # as after the all-reduce: the same on every rank
        p.grad = torch.full_like(p, 0.5 + seed)
    opt.step()
    opt.zero_grad()


def _ep(rank: int, world: int, root: str, save: bool) -> dict[str, torch.Tensor]:
    per = N_EXPERTS // world
    m = moe(list(range(rank * per, (rank + 1) * per)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)  # the shared block's parameters are in every rank's optimizer
    if save:
        for k in range(2):
            moe_step(m, opt, k)
        tg.save(f"{root}/step-000000002", {"model": m, "optim": opt}, split_state=True)
    else:
        tg.load(f"{root}/step-000000002", {"model": m, "optim": opt}, split_state=True)
    moe_step(m, opt, 2)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_expert_parallel_shared_block_in_every_optimizer_4_to_2_and_whole(tmp_path):
    """Every expert-parallel rank's optimizer holds the shared block: the merge refused it ('each
    parameter must belong to one stage's optimizer'), so no EP run could save."""
    m = moe(list(range(N_EXPERTS)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    for k in range(3):
        moe_step(m, opt, k)
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}
    run_ranks(_ep, 4, str(tmp_path), True, timeout=120, env=ENV)
    got = _union(run_ranks(_ep, 2, str(tmp_path), False, timeout=120, env=ENV))  # two experts a rank now
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    m = moe(list(range(N_EXPERTS)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    tg.load(tmp_path / "step-000000002", {"model": m, "optim": opt})
    assert len(opt.param_groups[0]["params"]) == 2 + 2 * N_EXPERTS  # the shared block's parameters once
    moe_step(m, opt, 2)
    assert all(torch.equal(p.detach(), ref[n]) for n, p in m.named_parameters())


def test_a_parameter_in_another_group_on_another_stage_is_refused():
    from trainguard.split import merge

    a = {"param_groups": [{"params": ["w", "x"], "lr": 1.0}, {"params": [], "lr": 2.0}]}
    b = {"param_groups": [{"params": ["y"], "lr": 1.0}, {"params": ["w"], "lr": 2.0}]}
    with pytest.raises(tg.UnsupportedValueError, match="'w' is in group 0 .* group 1"):
        merge(a, b, "optim", 1)
    b["param_groups"][1]["params"] = ["z"]
    assert [g["params"] for g in merge(a, b, "optim", 1)["param_groups"]] == [["w", "x", "y"], ["z"]]


class _RankLocal(tg.StateDict):
    trainguard_rank_local = True


def _one_stage_local(rank: int, world: int, root: str, save: bool) -> tuple[dict, bool]:
    """Each stage has a rank-local entry of its own (e.g. a data loader's position that only
    the first stage keeps): ``dl0`` on rank 0 only, ``dl1`` on rank 1 only."""
    m = stage([[0, 1], [2, 3]][rank])
    dl = _RankLocal(pos=100 + rank, t=torch.full((2,), float(rank + 1))) if save else _RankLocal()
    state = {"model": m, f"dl{rank}": dl}
    if save:
        tg.save(f"{root}/step-000000001", state, split_state=True)
    else:
        tg.load(f"{root}/step-000000001", state, split_state=True)
    return dict(dl), "t" in dl and torch.equal(dl["t"], torch.full((2,), float(rank + 1)))


def test_a_rank_local_entry_that_one_stage_holds_is_saved_and_restored(tmp_path):
    """rank 0's own rank-local entry failed the save with a bare KeyError ('dl0', collecting
    every rank's copy); another stage's was dropped from the manifest without a word (found
    only at the load: 'missing from the checkpoint: dl1')."""
    run_ranks(_one_stage_local, 2, str(tmp_path), True, timeout=90, env=ENV)
    out = run_ranks(_one_stage_local, 2, str(tmp_path), False, timeout=90, env=ENV)
    assert [r.value[0]["pos"] for r in out] == [100, 101]
    assert all(r.value[1] for r in out)


def _progress(rank: int, world: int, root: str, save: bool) -> dict:
    m = stage([[0, 1], [2, 3]][rank])
    if save:
        tg.save(f"{root}/step-000000002", {"model": m, "progress": tg.StateDict(step=2, tokens=123)}, split_state=True)
        return {}
    progress = tg.StateDict() if rank == 0 else tg.StateDict(step=0)  # filled by the load / the keys of a newer version
    tg.load(f"{root}/step-000000002", {"model": m, "progress": progress}, split_state=True)
    return dict(progress)


def test_a_counter_dict_is_loaded_whole_with_split_state(tmp_path):
    """The load pruned every dict entry to the keys the rank's dict already had: a fresh
    tg.StateDict() came back empty and StateDict(step=0) without 'tokens', without a word."""
    run_ranks(_progress, 2, str(tmp_path), True, timeout=90, env=ENV)
    out = run_ranks(_progress, 2, str(tmp_path), False, timeout=90, env=ENV)
    assert [r.value for r in out] == [{"step": 2, "tokens": 123}] * 2


def test_stages_with_different_optimizer_groups_are_told_what_differs():
    """A stage without no-decay parameters built one group where the others built two: the
    error showed both group lists cut at 80 characters (identical to the eye) and suggested
    making the optimizer rank-local."""
    from trainguard.split import merge

    g = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "params": ["a"]}
    two = {"param_groups": [g, {**g, "weight_decay": 0.0, "params": ["b"]}]}
    one = {"param_groups": [{**g, "params": ["c"]}]}
    with pytest.raises(tg.UnsupportedValueError, match=r"rank 0's stage has 2 parameter group\(s\), rank 1's 1.*may be empty"):
        merge(two, one, "optim", 1)
    other_lr = {"param_groups": [{**g, "params": ["c"], "lr": 0.02}, {**g, "weight_decay": 0.0, "params": []}]}
    with pytest.raises(tg.UnsupportedValueError, match=r"optim/param_groups/0/lr is 0.01 on rank 0's stage and 0.02") as e:
        merge(two, other_lr, "optim", 1)
    assert "rank-local" not in str(e.value)
    assert [x["params"] for x in merge(two, {"param_groups": [{**g, "params": ["c"]}, {**g, "weight_decay": 0.0, "params": []}]},
                                       "optim", 1)["param_groups"]] == [["a", "c"], ["b"]]
