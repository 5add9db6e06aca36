"""Review of what a state may hold (leaf types, dict kinds): round trips that must keep the
destination's types, and refusals that must say what to change. One process."""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict, defaultdict

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

import trainguard as tg


def _warmup_then_steps(model: nn.Module) -> tuple[torch.optim.Optimizer, sched.LRScheduler]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = sched.LinearLR(opt, start_factor=0.5, total_iters=3)
    return opt, sched.SequentialLR(opt, [warm, sched.MultiStepLR(opt, milestones=[5, 8])], milestones=[3])


def test_multistep_milestones_stay_a_counter_and_a_resumed_warmup_schedule_passes_its_switch(tmp_path):
    # MultiStepLR keeps its milestones in a collections.Counter; SequentialLR calls step(0) on it
    # at the switch, which needs Counter.elements(). Loaded as a plain dict, the resumed run
    # crashed there (AttributeError: 'dict' object has no attribute 'elements').
    model = nn.Linear(3, 2)
    opt, lr = _warmup_then_steps(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "step(0) is deprecated" at the switch
        opt.step()
        lr.step()
        tg.save(tmp_path / "step-000000001", {"model": model, "optim": opt, "sched": lr})
        model2 = nn.Linear(3, 2)
        opt2, lr2 = _warmup_then_steps(model2)
        tg.load(tmp_path / "step-000000001", {"model": model2, "optim": opt2, "sched": lr2})
        assert type(lr2._schedulers[1].milestones) is Counter
        for _ in range(8):
            opt.step()
            lr.step()
            opt2.step()
            lr2.step()
            assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_dict_kinds_come_back_as_the_destination_holds_them_and_as_dicts_into_nothing(tmp_path):
    def value() -> dict:
        return {
            "counts": Counter({"a": 2, 3: 1}),
            "seen": defaultdict(list, {"x": [1, torch.arange(2)]}),
            "order": OrderedDict([("b", 1), ("a", {"c": Counter()})]),
            "rows": [defaultdict(int, {"n": 1}), (Counter({1: 1}),)],
        }

    tg.save(tmp_path / "step-000000001", {"extra": value()})
    dest = {"extra": value()}
    tg.load(tmp_path / "step-000000001", dest)
    got = dest["extra"]
    assert type(got["counts"]) is Counter and got["counts"] == Counter({"a": 2, 3: 1})
    assert type(got["seen"]) is defaultdict and got["seen"].default_factory is list
    assert got["seen"]["x"][0] == 1 and torch.equal(got["seen"]["x"][1], torch.arange(2))
    assert got["seen"]["new"] == []  # the default_factory works again after a resume
    assert type(got["order"]) is OrderedDict and list(got["order"]) == ["b", "a"]
    assert type(got["order"]["a"]["c"]) is Counter
    assert type(got["rows"][0]) is defaultdict and got["rows"][0]["missing"] == 0
    assert type(got["rows"][1]) is tuple and type(got["rows"][1][0]) is Counter

    into_nothing = {"extra": None}  # no destination type to follow: plain dicts, equal values
    tg.load(tmp_path / "step-000000001", into_nothing)
    assert type(into_nothing["extra"]["counts"]) is dict and into_nothing["extra"]["counts"] == {"a": 2, 3: 1}


def test_step_sliced_columns_are_saved_and_only_views_that_really_share_memory_are_refused(tmp_path):
    # x[:, ::2] of a 5-wide matrix holds columns 0, 2, 4: strides (5, 2), no element shared.
    # The overlap check took a dimension's extent as stride * size (6 > 5) and refused it as
    # "an expand()ed or as_strided view", against the docs' "a transposed or sliced view" saved.
    x = torch.randn(4, 5)
    c = torch.randn(6, 5, dtype=torch.complex64)
    kept = {
        "cols": x[:, ::2],
        "corner": x[1:, 1::3],
        "real_of_cols": torch.view_as_real(c[:, ::2]),  # strides (10, 4, 1)
        "gappy": torch.arange(40.0).as_strided((3, 3), (5, 2)),  # offsets 0..14, all distinct
    }
    tg.save(tmp_path / "c", {"x": kept})
    out = {"x": None}
    tg.load(tmp_path / "c", out)
    for k, v in kept.items():
        assert torch.equal(out["x"][k], v), k
    # Views whose elements do share memory are still refused, before anything is written.
    for shared in (torch.arange(40.0).as_strided((3, 3), (4, 2)), torch.arange(40.0).as_strided((2, 4), (3, 1))):
        try:
            tg.save(tmp_path / "d", {"x": {"w": shared}})
        except tg.UnsupportedValueError as e:
            assert "x/w: tensor's elements share memory" in str(e)
        else:
            raise AssertionError(f"strides {shared.stride()} share memory and were saved")
        assert not (tmp_path / "d").exists()


def test_a_module_or_scheduler_nested_in_an_entry_is_refused_saying_to_make_it_an_entry(tmp_path):
    # The refusal said "wrap other objects in a class with state_dict()/load_state_dict()",
    # which a module already is: only top-level entries are adapted.
    gen = nn.Linear(2, 2)
    opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    for state, path in (
        ({"models": {"gen": gen}}, "models/gen"),
        ({"scheds": [sched.StepLR(opt, 2)]}, "scheds/0"),
        ({"extra": {"rng": tg.RNGState()}}, "extra/rng"),
    ):
        try:
            tg.save(tmp_path / "c", state)
        except tg.UnsupportedValueError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{path} was saved")
        assert msg.startswith(f"{path}: ") and "top-level entries" in msg and "wrap other objects" not in msg, msg
        assert not (tmp_path / "c").exists()


def test_an_int_and_a_str_key_holding_tensors_at_one_path_are_refused_naming_both_causes(tmp_path):
    # {1: t, "1": u} map to one path, x/1; the refusal told to remove '/' from keys that hold none.
    with pytest.raises(tg.UnsupportedValueError) as e:
        tg.save(tmp_path / "c", {"x": {1: torch.ones(1), "1": torch.zeros(1)}})
    assert str(e.value).startswith("x/1: ") and "1 and '1'" in str(e.value)
    with pytest.raises(tg.UnsupportedValueError, match=r"x/a/b: .*'/'"):
        tg.save(tmp_path / "c", {"x": {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}})
    assert not (tmp_path / "c").exists()
    # Non-tensor values under such keys have no path of their own: saved and loaded as they are.
    tg.save(tmp_path / "c", {"x": {1: "int", "1": "str", "a/b": 1, "a": {"b": 2}}})
    out = {"x": None}
    tg.load(tmp_path / "c", out)
    assert out["x"] == {1: "int", "1": "str", "a/b": 1, "a": {"b": 2}}


class _Amax(nn.Module):
    """Keeps a history in its extra state as a tensor whose size grows (as TransformerEngine's
    FP8 modules keep their metadata: a uint8 tensor of serialized bytes, empty when fresh)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.history: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(float(x.detach().abs().max()))
        return self.lin(x)

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.history, dtype=torch.float64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.history = state.tolist()


def test_a_module_extra_state_tensor_of_another_size_loads_strictly_into_a_fresh_module(tmp_path):
    # torch hands _extra_state to set_extra_state as it is; trainguard checked it like a
    # parameter: a fresh module's empty state was 'checkpoint float64[3], state float64[0]',
    # a StateMismatchError (strict) or a warning and the history silently kept empty (strict=False).
    model = nn.Sequential(_Amax(), _Amax())
    for _ in range(3):
        model(torch.randn(1, 2))
    tg.save(tmp_path / "c", {"model": model})
    fresh = nn.Sequential(_Amax(), _Amax())
    tg.load(tmp_path / "c", {"model": fresh})
    assert fresh[0].history == model[0].history and len(fresh[1].history) == 3
    assert torch.equal(fresh[0].lin.weight, model[0].lin.weight)
    # A missing parameter is still reported, next to a differing extra state.
    other = nn.Sequential(_Amax(), _Amax(), nn.Linear(2, 2))
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(tmp_path / "c", {"model": other})
    assert e.value.missing == ["model/2.weight", "model/2.bias"] and not e.value.unexpected and not e.value.mismatched
    # A checkpoint without the extra state at all: reported missing, before anything is read.
    tg.save(tmp_path / "plain", {"model": nn.Sequential(nn.Linear(2, 2))})
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(tmp_path / "plain", {"model": nn.Sequential(_Amax())})
    assert e.value.missing == ["model/0._extra_state", "model/0.lin.weight", "model/0.lin.bias"] and e.value.unexpected == ["model/0.weight", "model/0.bias"]


def test_a_checkpoint_loads_into_a_fresh_lazy_module_which_it_materializes(tmp_path):
    # torch's load_state_dict materializes LazyLinear's parameters from the state dict; the
    # loader asked their stride first and raised torch's ValueError ("uninitialized parameter").
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))
    model(torch.randn(2, 4))
    tg.save(tmp_path / "c", {"model": model, "extra": {"w": model[0].weight.detach().clone()}})
    fresh = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))
    lazy_w = nn.parameter.UninitializedParameter()
    state = {"model": fresh, "extra": {"w": lazy_w}}
    tg.load(tmp_path / "c", state)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert type(a) is torch.Tensor and torch.equal(a, b)  # materialized, as torch's own load does
    x = torch.randn(5, 4)
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(state["extra"]["w"], model[0].weight)  # a plain entry's: replaced by the loaded tensor


def test_saving_a_lazy_module_before_its_first_forward_is_refused_naming_the_parameter(tmp_path):
    # It failed as "could not capture the state: Can't access the shape of an uninitialized
    # parameter", naming no path.
    with pytest.raises(tg.UnsupportedValueError, match=r"^model/0\.weight: .*lazy.*forward"):
        tg.save(tmp_path / "c", {"model": nn.Sequential(nn.LazyLinear(3))})
    assert not (tmp_path / "c").exists()


def test_a_manifest_no_load_could_read_is_refused_before_the_commit(tmp_path, monkeypatch):
    """A state with ~1e8 small JSON values made a manifest over the 1 GiB a load reads: the save
    committed it, and every load then refused the checkpoint as corrupt. (The limit is lowered
    here, as the save and the load share it.)"""
    import trainguard.commit
    import trainguard.manifest
    from trainguard.errors import CheckpointError

    monkeypatch.setattr(trainguard.manifest, "MAX_MANIFEST_BYTES", 20_000)
    monkeypatch.setattr(trainguard.commit, "MAX_MANIFEST_BYTES", 20_000)
    ok, big = tmp_path / "run" / "step-000000001", tmp_path / "run" / "step-000000002"
    tg.save(ok, {"w": torch.ones(2), "n": list(range(100))})
    with pytest.raises(CheckpointError, match="over the 20000 a load reads"):
        tg.save(big, {"w": torch.ones(2), "n": list(range(10_000))})
    assert not big.exists() and [p.name for p in ok.parent.iterdir()] == [ok.name]
    got = {"w": torch.zeros(2), "n": []}
    tg.load(ok, got)
    assert got["n"] == list(range(100))
