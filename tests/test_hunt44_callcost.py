"""The async save's call, made cheaper (walks.py: one walk of each module per call; names.canonical_names:
one scan of all the names): what it takes must still be the state as at each call.

Each test saves, changes the state the way a training script may between two saves, saves
again, and loads both checkpoints: each must hold the state as at its own call. They guard any
reuse of a previous call's work (walks shared within a call only; a capture cache, if one is
ever built, must pass them too): keys added, removed and reordered; a parameter replaced, resized
or re-strided in place, or given another dtype or requires_grad; optimizer state created after
the first save, parameter groups added; values read fresh (lr, counters, RNG); a state_dict hook
added; another state dict object. Both async paths: ``tg.save(..., async_=True)`` and an async
``CheckpointManager``.
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import walks
from trainguard.names import canonical_key, canonical_names, frozen_names
from trainguard.stateful import ModuleAdapter, unwrap_module

MODES = ["direct", "manager"]


class Saver:
    """Two or more async saves into ``root``, by a direct ``tg.save`` or one open async manager."""

    def __init__(self, mode: str, root: Path) -> None:
        self.mode, self.root = mode, root
        self.mgr, self.last = None, None
        if mode == "manager":
            self.mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1000), keep=tg.KeepLatest(10), async_save=True,
                                            handle_signals=False).open()

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.mgr is None:
            self.last = tg.save(self.path(step), state, async_=True)  # awaited by the next async save, or by close()
        else:
            assert self.mgr.save(step, state, force=True) is not None

    def path(self, step: int) -> Path:
        return self.root / (f"step-{step:09d}" if self.mgr is not None else f"direct-{step}")

    def close(self) -> None:
        if self.mgr is None:
            self.last.result()
        else:
            self.mgr.close()

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads((self.path(step) / "manifest.json").read_text())["manifest"]


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, model[0].in_features, generator=g)).square().mean().backward()
    opt.step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _opt_sd(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


@pytest.mark.filterwarnings("ignore:1 optimizer parameter")  # the replaced one, still in the optimizer
@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_replaced_by_another_object_between_saves(tmp_path, mode) -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 0)
    s = Saver(mode, tmp_path)
    s.save(1, {"model": model, "optim": opt})
    ref1 = copy.deepcopy(model.state_dict())
    model[2].weight = nn.Parameter(torch.full((3, 6), 7.0))  # another object, other memory, not in the optimizer
    model[0].bias.data = torch.full((6,), -2.0)  # same Parameter object, new memory
    s.save(2, {"model": model, "optim": opt})
    ref2 = copy.deepcopy(model.state_dict())
    s.close()
    assert not _same(ref1, ref2)
    for step, ref in ((1, ref1), (2, ref2)):
        m = _mlp(5)
        tg.load(s.path(step), {"model": m}, only=["model"])
        assert _same(m.state_dict(), ref), step


@pytest.mark.parametrize("mode", MODES)
def test_resized_and_restrided_in_place_between_saves(tmp_path, mode) -> None:
    t = torch.arange(6, dtype=torch.float32)
    buf = torch.arange(12, dtype=torch.float64)
    s = Saver(mode, tmp_path)
    s.save(1, {"t": t, "b": tg.StateDict(buf=buf)})
    t.resize_(10).copy_(torch.arange(10, 20))  # same tensor object, new size (and maybe new memory)
    buf.set_(torch.arange(100, 112, dtype=torch.float64).reshape(3, 4).t())  # same object, other memory, transposed
    s.save(2, {"t": t, "b": tg.StateDict(buf=buf)})
    s.close()
    m1, m2 = s.manifest(1), s.manifest(2)
    shapes = [{p: e["shape"] for p, e in m["tensors"].items()} for m in (m1, m2)]
    for step, shape_t, shape_b, first in ((1, (6,), (12,), 0.0), (2, (10,), (4, 3), 10.0)):
        got = {"t": torch.zeros(shape_t), "b": tg.StateDict(buf=torch.zeros(shape_b, dtype=torch.float64))}
        tg.load(s.path(step), got)
        assert got["t"][0].item() == first and got["t"].shape == shape_t, step
        want = torch.arange(12, dtype=torch.float64) if step == 1 else torch.arange(100, 112, dtype=torch.float64).reshape(3, 4).t()
        assert torch.equal(got["b"]["buf"], want), step
    assert shapes == [{"t": [6], "b/buf": [12]}, {"t": [10], "b/buf": [4, 3]}]


@pytest.mark.parametrize("mode", MODES)
def test_dtype_and_requires_grad_changed_between_saves(tmp_path, mode) -> None:
    model = _mlp()
    s = Saver(mode, tmp_path)
    s.save(1, {"model": model})
    model.double()  # same Parameter objects, new dtype
    model[0].weight.requires_grad_(False)
    s.save(2, {"model": model})
    s.close()
    assert s.manifest(1)["objects"]["model"]["frozen"] == []
    assert s.manifest(2)["objects"]["model"]["frozen"] == ["0.weight"]
    m = _mlp(3)
    tg.load(s.path(1), {"model": m})
    assert m[0].weight.dtype == torch.float32 and torch.equal(m[0].weight, _mlp()[0].weight)
    m = _mlp(3).double()
    tg.load(s.path(2), {"model": m})
    assert torch.equal(m[2].weight, model[2].weight)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_state_created_after_the_first_save_and_groups_added(tmp_path, mode) -> None:
    model = _mlp()
    extra = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    s = Saver(mode, tmp_path)
    s.save(1, {"model": model, "extra": extra, "optim": opt})  # no Adam state yet (lazy: the first step makes it)
    ref1 = _opt_sd(opt)
    _train(model, opt, 1)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    s.save(2, {"model": model, "extra": extra, "optim": opt})
    ref2 = _opt_sd(opt)
    s.close()
    assert ref1["state"] == {} and ref2["state"]
    m, e = _mlp(), nn.Linear(2, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    tg.load(s.path(1), {"model": m, "extra": e, "optim": o})
    assert _same(o.state_dict(), ref1)
    m, e = _mlp(), nn.Linear(2, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    o.add_param_group({"params": list(e.parameters()), "lr": 0.1})
    tg.load(s.path(2), {"model": m, "extra": e, "optim": o})
    assert _same(o.state_dict(), ref2)
    assert o.param_groups[1]["lr"] == 0.5


@pytest.mark.filterwarnings("ignore:entry 'sched'", "ignore::trainguard.OptimizerSettingsWarning")  # wanted here
@pytest.mark.parametrize("mode", MODES)
def test_plain_values_are_read_at_each_call(tmp_path, mode) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    progress = tg.StateDict(step=1, tokens=10)
    rng = tg.RNGState()
    torch.manual_seed(11)
    state = {"model": model, "optim": opt, "sched": sched, "progress": progress, "rng": rng}
    s = Saver(mode, tmp_path)
    s.save(1, state)
    draw1 = torch.rand(3)  # what the RNG gives after save 1
    _train(model, opt, 2)
    sched.step()
    progress["step"], progress["tokens"] = 2, 25
    opt.param_groups[0]["momentum"] = 0.5
    torch.manual_seed(22)
    s.save(2, state)
    draw2 = torch.rand(3)
    s.close()
    for step, lr, momentum, tokens, draw in ((1, 0.1, 0.9, 10, draw1), (2, 0.05, 0.5, 25, draw2)):
        m = _mlp()
        o = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.1)
        sc = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        got = {"model": m, "optim": o, "sched": sc, "progress": tg.StateDict(), "rng": tg.RNGState()}
        tg.load(s.path(step), got)
        assert got["progress"] == {"step": step, "tokens": tokens}
        assert o.param_groups[0]["lr"] == pytest.approx(lr) and o.param_groups[0]["momentum"] == momentum
        assert sc.last_epoch == step - 1
        assert torch.equal(torch.rand(3), draw), step


@pytest.mark.parametrize("mode", MODES)
def test_keys_added_removed_reordered_and_another_state_object(tmp_path, mode) -> None:
    a, b = _mlp(1), _mlp(2)
    state = {"a": a, "b": b}
    s = Saver(mode, tmp_path)
    s.save(1, state)
    ref_a1, ref_b1 = copy.deepcopy(a.state_dict()), copy.deepcopy(b.state_dict())
    b.add_module("3", nn.Linear(3, 2))  # a submodule added (the same state object, keys and entries)
    del a[2].bias  # a parameter removed (no registration hook sees a delattr)
    s.save(2, state)
    s.save(3, {"b": a, "a": b, "c": tg.StateDict(n=3)})  # the same objects under swapped keys, in another dict
    s.close()
    assert set(s.manifest(2)["objects"]) == {"a", "b"} and set(s.manifest(3)["objects"]) == {"a", "b", "c"}
    one = {"a": _mlp(7), "b": _mlp(8)}
    tg.load(s.path(1), one)
    assert _same(one["a"].state_dict(), ref_a1) and _same(one["b"].state_dict(), ref_b1)
    with pytest.raises(tg.CheckpointError):  # the first checkpoint holds neither the added submodule nor its values
        tg.load(s.path(1), {"a": a, "b": b})
    a2, b2 = _mlp(7), _mlp(8)
    del a2[2].bias
    b2.add_module("3", nn.Linear(3, 2))
    tg.load(s.path(2), {"a": a2, "b": b2})
    assert _same(a2.state_dict(), a.state_dict()) and _same(b2.state_dict(), b.state_dict())
    a3, b3 = _mlp(7), _mlp(8)
    del a3[2].bias
    b3.add_module("3", nn.Linear(3, 2))
    got = {"a": b3, "b": a3, "c": tg.StateDict()}
    tg.load(s.path(3), got)
    assert _same(a3.state_dict(), a.state_dict()) and _same(b3.state_dict(), b.state_dict()) and got["c"] == {"n": 3}


@pytest.mark.parametrize("mode", MODES)
def test_a_state_dict_hook_added_between_saves_runs(tmp_path, mode) -> None:
    model = _mlp()
    s = Saver(mode, tmp_path)
    s.save(1, {"model": model})

    def scale(module, sd, prefix, local_metadata):  # a wrapper's post hook: what the module saves, changed
        sd[prefix + "0.weight"] = sd[prefix + "0.weight"] * 0 + 3.0
        return sd

    model._register_state_dict_hook(scale)
    s.save(2, {"model": model})
    s.close()
    m = _mlp(4)
    tg.load(s.path(1), {"model": m})
    assert torch.equal(m[0].weight, _mlp()[0].weight)
    tg.load(s.path(2), {"model": m})
    assert torch.equal(m[0].weight, torch.full((6, 4), 3.0))


@pytest.mark.parametrize("mode", MODES)
def test_frozen_then_unfrozen_with_a_tie_and_a_shared_submodule(tmp_path, mode) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.ModuleDict({"enc": shared, "dec": nn.Sequential(shared, nn.Linear(3, 3))})
    model["dec"][1].weight = model["enc"].weight  # a tie: one Parameter under two names
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model["enc"].parameters():
        p.requires_grad_(False)
    s = Saver(mode, tmp_path)
    s.save(1, {"model": model, "optim": opt})
    for p in model["enc"].parameters():
        p.requires_grad_(True)
    s.save(2, {"model": model, "optim": opt})
    s.close()
    assert s.manifest(1)["objects"]["model"]["frozen"] == ["enc.bias", "enc.weight"]
    assert s.manifest(2)["objects"]["model"]["frozen"] == []


def _old_frozen(module: nn.Module) -> list[str]:  # names.frozen_names before it used walks.named_parameters
    return sorted({canonical_key(n) for n, p in unwrap_module(module).named_parameters() if not p.requires_grad})


def _zoo() -> list[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    tied = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared, nn.Linear(3, 3), nn.Linear(3, 3))})
    tied["b"][2].weight = tied["b"][1].weight
    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.Linear(2, 2))
    compiled = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    out = [tied, wrapped, compiled, nn.Sequential(*[nn.Linear(1, 1) for _ in range(5)])]
    for k, m in enumerate(out):
        for i, p in enumerate(m.parameters()):
            p.requires_grad_((i + k) % 3 != 0)
    return out


def test_frozen_names_from_the_shared_walk_equal_named_parameters_own() -> None:
    for m in _zoo():
        want = _old_frozen(m)
        assert frozen_names(m) == want
        with walks.shared():  # after the names' walk of the same call, as a save takes them
            ModuleAdapter(m).param_names()
            assert frozen_names(m) == want
    assert any(_old_frozen(m) for m in _zoo())


def test_canonical_names_scan_gives_what_each_name_gives() -> None:
    m = nn.Linear(1, 1)
    for names in (["a.weight", "b._orig_mod.c"], ["x._checkpoint_wrapped_module.w", "y"], ["_fsdp_wrapped_module"],
                  ["a", "b.c"], [], ["a\0_orig", "_mod"]):
        assert canonical_names(m, list(names)) == [canonical_key(n) for n in names], names


def test_walks_are_shared_within_a_block_only_and_per_thread() -> None:
    m = nn.Sequential(nn.Linear(1, 1))
    with walks.shared():
        first = walks.modules(m)
        m.add_module("1", nn.Linear(1, 1))
        assert walks.modules(m) is first and len(first) == 2  # one walk per call
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(len(walks.modules(m))))
        t.start()
        t.join()
        assert seen == [3]  # another thread (a load meanwhile) walks afresh
    assert len(walks.modules(m)) == 3 and walks.modules(m) is not first  # the next call walks afresh


def test_an_inference_tensor_among_watched_ones_is_saved(tmp_path) -> None:
    """``handle.watch`` reads each version counter in one pass; an inference tensor has none (it
    raises): the pass falls back to one tensor at a time, None for it, and the save goes on."""
    with torch.inference_mode():
        frozen = torch.arange(4.0)
    plain = torch.arange(3.0)
    h = tg.save(tmp_path / "c", {"a": frozen, "b": plain}, async_=True, stage_in_background=True)
    h.wait_staged()
    h.result()
    got = {"a": torch.zeros(4), "b": torch.zeros(3)}
    tg.load(tmp_path / "c", got)
    assert torch.equal(got["a"], torch.arange(4.0)) and torch.equal(got["b"], plain)
