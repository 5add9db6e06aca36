"""Review of ``split_state=True`` (docs/distributed.md, "Pipeline stages and experts"): rank-local
entries that only some stages hold, loaded where the rank's own slot is empty; a tensor that
groups hold with different shardings; the merge of many groups' skeletons."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import run_ranks

N_LAYERS = 4
ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def full_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.layers = nn.ModuleDict({str(i): nn.Linear(6, 6) for i in range(N_LAYERS)})
    return m


def stage(layers: list[int]) -> nn.Module:
    m = full_model()
    for i in range(N_LAYERS):
        if i not in layers:
            del m.layers[str(i)]
    return m


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
