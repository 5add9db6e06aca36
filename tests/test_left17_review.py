"""Review of session 17's "left alone" list: what broke, reproduced, and fixed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from test_memory16_review import _titan_model, _titan_step
from trainguard.convert import convert
from trainguard.errors import CheckpointError

# ----------------------------------------------------------------------------- torchtitan DCP: equal groups


def _titan_dcp(tmp_path: Path, groups: Any) -> tuple[Any, Any]:
    """A torchtitan-like DCP checkpoint (model keys at the top level, the optimizer flattened by
    ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``) of a model trained two steps
    with the AdamW that ``groups(model)`` builds, converted into ``tmp_path / "tg"``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    m = _titan_model()
    opt = groups(m)
    for _ in range(2):
        _titan_step(m, opt)
    flat = get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group; DCP's metadata is a pickle
        dcp.save({**get_model_state_dict(m), "optimizer": flat}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "t")), no_dist=True)
        convert(tmp_path / "t", tmp_path / "tg")
    return m, opt


def _two_equal_groups(m: Any) -> Any:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay}, {"params": rest}], lr=1e-2, weight_decay=0.1)


def test_torchtitan_optimizer_with_two_equal_groups_loads_into_its_two_groups(tmp_path) -> None:
    """The flat form keeps each parameter's group values, not the groups: two groups with equal
    values (decay/no-decay before the no-decay group's weight_decay is set) were imported as one,
    and loading into the same 2-group AdamW was refused ("the checkpoint has 1 parameter
    group(s), the optimizer 2"). DCP's own set_optimizer_state_dict matches them by parameter;
    now the load does too, and the next step is bit-identical."""
    m, opt = _titan_dcp(tmp_path, _two_equal_groups)
    m2 = _titan_model()
    opt2 = _two_equal_groups(m2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.load(tmp_path / "tg", {"model": m2, "optimizer": opt2})
    assert [len(g["params"]) for g in opt2.param_groups] == [len(g["params"]) for g in opt.param_groups]
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
    opt.param_groups[1]["weight_decay"] = opt2.param_groups[1]["weight_decay"] = 0.0  # the groups are distinct again
    _titan_step(m, opt)
    _titan_step(m2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))


def test_torchtitan_optimizer_groups_of_other_values_still_refuse_a_merged_group(tmp_path) -> None:
    """A real mismatch stays refused, naming what differs: groups saved with different values
    (weight_decay 0.1 and 0.0) into an optimizer that puts those parameters in one group."""

    def distinct(m: Any) -> Any:
        decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)

    _titan_dcp(tmp_path, distinct)
    m2 = _titan_model()
    merged = torch.optim.AdamW([{"params": list(m2.parameters())[:3]}, {"params": list(m2.parameters())[3:]}], lr=1e-2)
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match="different group values.*weight_decay"):
        warnings.simplefilter("ignore")
        tg.load(tmp_path / "tg", {"model": m2, "optimizer": merged})
    one = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match="entry 'optimizer'.*different group values"):
        warnings.simplefilter("ignore")
        tg.load(tmp_path / "tg", {"model": m2, "optimizer": one})


# ----------------------------------------------------------------------------- mismatched operations: who is where


def _early_close(rank: int, world: int, root: str) -> Any:
    """Rank 0's loop ends a step early and closes its manager; rank 1 calls save (its "decide")."""
    from dist_helper import attempt

    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(100), timeout=20).open()  # signals: a "decide" round
    if rank == 0:
        mgr.close()
        return {"type": None}
    out = attempt(lambda: mgr.save(1, {"x": torch.zeros(2)}))
    mgr.__dict__["_failing"] = True  # no closing round: rank 0 is gone
    mgr.close()
    return out


def test_a_rank_in_another_operation_is_told_where_the_others_are(tmp_path) -> None:
    """Rank 0 closed its manager while rank 1 called save: rank 1 was told "close: rank(s) [1]
    are in ['decide'] instead of 'close'", naming itself as the one elsewhere. Now the message
    says which ranks called which operation, from any rank's point of view."""
    from dist_helper import run_ranks

    r = run_ranks(_early_close, 2, str(tmp_path / "ck"), timeout=60)
    out = r[1].value
    assert out["type"] == "RankFailureError", out
    msg = out["msg"]
    assert "rank(s) [1] are in" not in msg, msg
    assert "rank 0 called 'close'" in msg and "rank 1 called 'decide'" in msg, msg


# ----------------------------------------------------------------------------- a permanent save error, then the store lost


class _LostStore:
    """A rank's context whose exchange fails as when rank 0's process (the c10d store's host)
    has exited: what rank 1 sees after rank 0 read its error and exited 78."""

    is_distributed, rank, world_size = True, 1, 2

    def all_gather(self, tag: str, *a: Any, **k: Any) -> Any:
        from trainguard.errors import failure

        raise failure(f"{tag}: the c10d store stopped answering (DistNetworkError: Connection reset by peer); "
                      "the process hosting it (rank 0, or the launcher) died or hangs", {0: "unreachable"})


def test_a_save_refused_for_good_stays_permanent_when_the_store_is_lost() -> None:
    """Rank 1's save was refused for good (a value that cannot be saved: UnsupportedValueError,
    exit 78 at every restart); it told the other ranks in the save's "begin" round, rank 0 read it
    and exited 78, and its process hosted the store: rank 1's exchange failed with "the c10d store
    stopped answering", which is no permanent error, and it exited 1 (its agent restarts). Now, as
    for a load's error (errors.agree_load), its own error no restart fixes is what it raises. A
    transient error of its own (a bug, an OSError) still lets the lost store through."""
    from trainguard.api import _collective_capture
    from trainguard.errors import RankFailureError

    with pytest.raises(tg.UnsupportedValueError) as e:
        _collective_capture({"x": torch.zeros(2), "bad": object()}, _LostStore(), "sharded", None)  # type: ignore[arg-type]
    assert tg.exit_code_for(e.value) == 78
    with pytest.raises(RankFailureError, match="stopped answering") as f:
        _collective_capture({"x": torch.zeros(2)}, _LostStore(), "sharded", None, preflight=OSError(5, "EIO"))  # type: ignore[arg-type]
    assert tg.exit_code_for(f.value) == 1
