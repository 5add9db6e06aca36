"""Review of ``split_state=True`` (docs/distributed.md, "Pipeline stages and experts"): rank-local
entries that only some stages hold, loaded where the rank's own slot is empty; a tensor that
groups hold with different shardings; the merge of many groups' skeletons."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainguard as tg
from test_split_state import full_model, stage  # the same stages as the feature's tests

from dist_helper import run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


class _RankLocal(tg.StateDict):
    trainguard_rank_local = True


def _loader_on_stage1(rank: int, world: int, root: str, load: bool) -> dict:
    """A data loader's position (rank-local) that only stage 1 keeps at the save; at the load
    both stages hold one (rank 0's saved slot is empty)."""
    m = stage([[0, 1], [2, 3]][rank])
    state: dict = {"model": m}
    if load:
        state["dl"] = _RankLocal()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            tg.load(f"{root}/step-1", state, split_state=True)
        return {"dl": dict(state["dl"]), "warned": any("dl" in str(x.message) for x in w)}
    if rank == 1:
        state["dl"] = _RankLocal(pos=42, t=torch.full((2,), 7.0))
    tg.save(f"{root}/step-1", state, split_state=True)
    return {}


def test_a_rank_local_entry_of_one_stage_loads_where_the_rank_s_own_slot_is_empty(tmp_path):
    """Saved as {"ranks": [None, <rank 1's>]}: a whole-model load took rank 0's slot, found None
    and skipped the entry (a warning about the world size only); a split load whose rank 0 now
    holds the entry skipped it without a word. Both take a saved copy (docs: rank-local state
    when the world size changes) and say so."""
    run_ranks(_loader_on_stage1, 2, str(tmp_path), False, timeout=90, env=ENV)
    dl = _RankLocal()
    with pytest.warns(UserWarning, match="dl: no saved state for rank 0.*saved rank 1"):
        tg.load(tmp_path / "step-1", {"model": full_model(), "dl": dl})
    assert dl["pos"] == 42 and torch.equal(dl["t"], torch.full((2,), 7.0))
    out = run_ranks(_loader_on_stage1, 2, str(tmp_path), True, timeout=90, env=ENV)
    for r in out:
        assert r.value["dl"]["pos"] == 42 and torch.equal(r.value["dl"]["t"], torch.full((2,), 7.0)), r.value
    assert [r.value["warned"] for r in out] == [True, False]  # rank 1 takes its own


def test_saved_slot_rule():
    from trainguard.split import saved_slot

    assert saved_slot([None, "a"], 0) == 1
    assert saved_slot(["a", "b"], 1) == 1 and saved_slot(["a", "b"], 3) == 1
    assert saved_slot(["a", None, "c"], 1) == 2 and saved_slot(["a", None, "c"], 4) == 0
    assert saved_slot([None, None], 0) is None


def _sharded_differently(rank: int, world: int, root: str, differ: bool) -> str:
    """A ``shared`` layer on both stages of a pp x dp mesh: ``fully_shard``ed over stage 0's
    ``mesh["dp"]`` (two row boxes), plain on stage 1 (one whole box), different values on
    stage 1 when ``differ``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    m = stage([[0, 1], [2, 3]][rank // 2])
    m.shared = nn.Linear(6, 6)
    if rank >= 2 and differ:
        with torch.no_grad():
            m.shared.weight.add_(1.0)
    if rank < 2:
        fully_shard(m.shared, mesh=mesh["dp"])
    try:
        tg.save(f"{root}/step-1", {"model": m}, split_state=True)
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


def test_a_tensor_that_stages_shard_differently_is_not_committed_unchecked(tmp_path):
    """Block checksums were compared only for equal boxes: stage 0's two row shards and stage
    1's whole tensor were never compared, and the save kept stage 0's values without a word."""
    out = run_ranks(_sharded_differently, 4, str(tmp_path), True, timeout=120, env=ENV)
    for r in out:
        assert "shared.weight" in r.value and "differently" in r.value, r.value
    assert not (tmp_path / "step-1").exists()


def _big_shared(rank: int, world: int, root: str, differ: bool) -> str:
    """A plain ``shared`` tensor above the row-split size on both stages: stage 0 has two
    ranks (its replicas spread the tensor's rows), stage 1 one (which wrote it whole)."""
    from trainguard import planner

    planner.row_split.__defaults__ = (64,)  # a 6x6 float32 tensor (144 bytes) is split into rows of 64 bytes
    m = stage([[0, 1], [0, 1], [2, 3]][rank])
    m.register_buffer("shared", torch.arange(36.0).reshape(6, 6) + (rank == 2 and differ))
    try:
        tg.save(f"{root}/step-1", {"model": m}, split_state=True)
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("differ", [False, True])
def test_a_large_replicated_tensor_in_stages_of_different_sizes_is_compared(tmp_path, differ):
    """A group of one rank wrote a replicated tensor whole, a group of two in row ranges: the
    boxes differed and the values were never compared. Rows are now the same in every group."""
    out = run_ranks(_big_shared, 3, str(tmp_path), differ, timeout=120, env=ENV)
    for r in out:
        assert ("shared" in r.value and "different values" in r.value) if differ else r.value == "saved", r.value
    if not differ:
        m = full_model()
        m.register_buffer("shared", torch.zeros(6, 6))
        tg.load(tmp_path / "step-1", {"model": m})
        assert torch.equal(m.shared, torch.arange(36.0).reshape(6, 6))


def _skel(names: list[str], lr: float = 0.01, groups: int = 1) -> dict:
    state = {n: {"exp_avg": {"$t": f"optim/state/{n}/exp_avg"}} for n in names}
    pgs = [{"lr": lr, "betas": [0.9, 0.999], "params": names if i == 0 else []} for i in range(groups)]
    return {"model": {n: {"$t": f"model/{n}"} for n in names}, "optim": {"state": state, "param_groups": pgs}}


def _reports(*skels: dict) -> list[dict]:
    return [{"chunks": [], "objects": {}, "split": None}] + [
        {"chunks": [], "objects": {}, "split": {"skeletons": s, "leaves": []}} for s in skels
    ]


def test_many_groups_merge_in_place_without_touching_the_inputs():
    """The merge of many groups' skeletons is done in place (linear in the reports, not in
    groups x union): rank 0's skeleton and the reports are left as they were, parameters that
    several groups hold are listed once, and the checks still see every group's parameters."""
    import copy

    from trainguard.split import add_reported

    mine = _skel(["s", "a0"])
    others = [_skel(["s", f"a{g}"]) for g in range(1, 5)]
    before = copy.deepcopy((mine, others))
    objects = {k: {"skeleton": v} for k, v in mine.items()}
    add_reported({}, objects, _reports(*others), None)
    assert (mine, others) == before
    union = ["s", "a0", "a1", "a2", "a3", "a4"]
    assert objects["optim"]["skeleton"]["param_groups"][0]["params"] == union
    assert list(objects["model"]["skeleton"]) == list(objects["optim"]["skeleton"]["state"]) == union
    # The fourth group holds a0 (rank 0's group 0) in its group 1; the third another lr.
    late = _skel(["s", "b"], groups=2)
    late["optim"]["param_groups"][1]["params"] = ["a0"]
    objects = {k: {"skeleton": v} for k, v in _skel(["s", "a0"], groups=2).items()}
    with pytest.raises(tg.UnsupportedValueError, match="'a0' is in group 0 .* group 1 .*rank 3's"):
        add_reported({}, objects, _reports(_skel(["c"], groups=2), _skel(["d"], groups=2), late), None)
    objects = {k: {"skeleton": v} for k, v in mine.items()}
    with pytest.raises(tg.UnsupportedValueError, match="param_groups/0/lr is 0.01 on rank 0's stage and 0.02 on rank 3's"):
        add_reported({}, objects, _reports(others[0], others[1], _skel(["e"], lr=0.02)), None)
