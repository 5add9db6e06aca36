"""Session 56, review56c: a hostile review of the load path (tg.load, restore, DCP interop).

- A plain dict entry (``progress = {"step": 0}``, ``state = {"progress": progress}``) was replaced
  by a new dict on load: the script's own ``progress`` kept its fresh values after a restore,
  silently (a loop ``for step in range(progress["step"], n)`` started again at 0). Now it is
  filled in place, nested dicts and lists too; a read-only state whose dict entry differs loads
  into it instead of refusing.
- A strict load in one process of a checkpoint one process saved, into a model that lacks layers,
  advised ``split_state=True`` (for ranks that each hold a pipeline stage), which would have loaded
  the part silently.
- ``convert --to dcp`` and back lost every empty dict of the state (DCP writes no item for one), and
  the state it came from no longer loaded strictly.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import trainguard as tg
from trainguard.convert import convert


def test_a_plain_dict_entry_is_loaded_into_the_scripts_own_dict(tmp_path):
    path = tmp_path / "step-000000007"
    tg.save(path, {"progress": {"step": 7, "seen": [1, 2], "sub": {"n": 3, "w": torch.ones(2)}}})
    progress = {"step": 0, "seen": [], "sub": {"n": 0, "w": torch.zeros(2)}}
    seen, sub, w = progress["seen"], progress["sub"], progress["sub"]["w"]
    tg.load(path, {"progress": progress})
    assert progress["step"] == 7 and seen == [1, 2] and sub["n"] == 3  # before: 0, [], 0
    assert progress["sub"] is sub and sub["w"] is w and torch.equal(w, torch.ones(2))


def test_a_plain_dict_entry_is_restored_in_place_by_the_manager(tmp_path):
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(5, {"progress": {"step": 5}})
    progress = {"step": 0}
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.restore({"progress": progress})
    assert progress == {"step": 5}


def test_a_read_only_state_takes_a_dict_entry_in_place(tmp_path):
    path = tmp_path / "step-000000001"
    tg.save(path, {"cfg": {"n": 4}})
    cfg = {"n": 0}
    tg.load(path, types.MappingProxyType({"cfg": cfg}))  # before: refused, "this entry is replaced on load"
    assert cfg == {"n": 4}


def test_a_statedicts_nested_dict_is_filled_in_place(tmp_path):
    path = tmp_path / "step-000000001"
    tg.save(path, {"p": tg.StateDict(step=2, best={"loss": 0.5})})
    p = tg.StateDict(step=0, best={"loss": 9.0})
    best = p["best"]
    tg.load(path, {"p": p})
    assert p["step"] == 2 and best == {"loss": 0.5}


def test_a_plain_tensor_of_another_shape_is_still_replaced_as_documented(tmp_path):
    path = tmp_path / "step-000000001"
    tg.save(path, {"extra": {"w": torch.ones(3)}})
    extra = {"w": torch.zeros(4)}
    tg.load(path, {"extra": extra})
    assert torch.equal(extra["w"], torch.ones(3))  # the same dict, the new tensor


def _two_layers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


def test_a_one_process_load_is_not_told_to_pass_split_state(tmp_path):
    path = tmp_path / "step-000000001"
    tg.save(path, {"model": _two_layers()})
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(path, {"model": torch.nn.Sequential(torch.nn.Linear(2, 2))})
    assert "model/1.weight" in str(e.value) and "split_state" not in str(e.value)


def test_a_one_process_optimizer_load_is_not_told_to_pass_split_state(tmp_path):
    path = tmp_path / "step-000000001"
    model = _two_layers()
    tg.save(path, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, {"model": small, "optim": torch.optim.SGD(small.parameters(), lr=0.1)})
    assert "entry 'optim'" in str(e.value) and "split_state" not in str(e.value)


def test_the_split_state_advice_depends_on_the_loading_and_saving_world():
    from trainguard.rankload import split_hint

    assert "split_state=True" in split_hint(4, 4) and "split_state=True" in split_hint(2, 1)
    assert split_hint(1, 1) == ""
    one = split_hint(1, 4)
    assert "saved by 4 ranks" in one and "split_state=True" in one
    assert split_hint(2, 2, sentence=False).startswith("; ranks that each hold part")


def _with_empties(model: torch.nn.Module) -> dict:
    return {
        "model": model,
        "extra": {"a": {}, "b": 1, "d": {"e": {}}, "l": [{}, 2]},
        "empty": {},
        "p": tg.StateDict(step=3, hist={}),
    }


def test_empty_dicts_survive_a_round_trip_through_dcp(tmp_path):
    torch.manual_seed(0)
    src, out, back = tmp_path / "ck" / "step-000000001", tmp_path / "dcp", tmp_path / "back" / "step-000000001"
    model = torch.nn.Linear(2, 2)
    tg.save(src, _with_empties(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's metadata is a pickle: convert warns on import
        convert(src, out, dst_format="dcp", entry=None)
        convert(out, back)
    state = _with_empties(torch.nn.Linear(2, 2))
    state["extra"]["b"], state["p"]["step"] = 0, 0
    tg.load(back, state)  # before: missing from the checkpoint (5): empty, extra/a, extra/d, extra/l, p/hist
    assert state["extra"] == {"a": {}, "b": 1, "d": {"e": {}}, "l": [{}, 2]} and state["empty"] == {}
    assert dict(state["p"]) == {"step": 3, "hist": {}}
    assert torch.equal(state["model"].weight, model.weight)


def test_torchs_own_readers_still_read_the_exported_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, out = tmp_path / "ck" / "step-000000001", tmp_path / "dcp"
    model = torch.nn.Linear(2, 2)
    state = _with_empties(model)
    del state["extra"]["l"]  # a list holding a dict: dcp_to_torch_save cannot rebuild it, empty dicts or not
    tg.save(src, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(src, out, dst_format="dcp", entry=None)
        msd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load({"model": msd}, checkpoint_id=str(out), no_dist=True)
        dcp_to_torch_save(str(out), str(tmp_path / "all.pt"))
    assert torch.equal(msd["weight"], model.weight.detach())
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert torch.equal(whole["model"]["bias"], model.bias.detach()) and whole["extra"]["b"] == 1
    assert "a" not in whole["extra"]  # torch's reader rebuilds what has items: the empty dicts' record is ignored


class _Tied(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
        if tie:
            self.head.weight = self.emb.weight


@pytest.mark.parametrize("saved_tied", [True, False])
@pytest.mark.parametrize("ema", [False, True])
def test_a_tie_made_or_undone_since_the_save_is_named_as_such_by_the_optimizers_refusal(tmp_path, saved_tied, ema):
    # Before: "added to the model since the save" (saved tied, loaded untied) or "removed from the
    # model since the save, or left out of the optimizer ... frozen" (the reverse).
    path = tmp_path / "step-000000001"
    model = _Tied(saved_tied)
    optim = torch.optim.Adam(model.parameters())
    model.head(model.emb(torch.tensor([1, 2]))).sum().backward()
    optim.step()
    extra = {"ema": torch.nn.Linear(2, 2)} if ema else {}  # two module entries: names prefixed by the entry's key
    tg.save(path, {"model": model, **extra, "optim": optim})
    other = _Tied(not saved_tied)
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, {"model": other, **extra, "optim": torch.optim.Adam(other.parameters())})
    msg = str(e.value)
    pre = "model." if ema else ""
    assert f"'{pre}head.weight' to '{pre}emb.weight'" in msg, msg
    assert ("tie them again" if saved_tied else "build the model untied") in msg
    assert "added to the model" not in msg and "removed from the model" not in msg


def test_a_non_strict_load_names_the_module_tensors_it_leaves_alone(tmp_path):
    path = tmp_path / "step-000000001"
    tg.save(path, {"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), "p": tg.StateDict(step=1)})
    bigger = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Identity(), torch.nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"left as they are, which the checkpoint lacks: model/2\.weight, model/2\.bias"):
        tg.load(path, {"model": bigger, "p": tg.StateDict(step=0, tokens=0)}, strict=False)
    smaller = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"of the checkpoint's not read, which the state lacks: model/1\.weight"):
        tg.load(path, {"model": smaller, "p": tg.StateDict(step=0)}, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same modules: nothing to say
        tg.load(path, {"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
                       "p": tg.StateDict(step=0, tokens=0)}, strict=False)


def test_an_entry_renamed_since_the_save_is_named_with_the_line_that_renames_it(tmp_path):
    path = tmp_path / "step-000000001"
    model = torch.nn.Linear(2, 2)
    tg.save(path, {"model": model})
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(path, {"modle": model})
    assert "state['model'] = state.pop('modle')" in str(e.value)
