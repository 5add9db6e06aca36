"""Session 58, review58e: a hostile review of review58b's fine-tuning loads. All in one process, no ranks.

- A state dict saved from a DDP-wrapped model that has its own child named ``module`` (an EMA wrapper,
  ``module.module.fc.weight``) had every leading ``module.`` dropped: into a model holding both ``fc`` and
  ``module.fc``, a ``strict=False`` load read the checkpoint's ``module.fc`` into ``fc``, and reported the
  right one missing; into the bare EMA wrapper it was refused. Only the prefix the wrapper added is dropped now.
- ``DDP(model).state_dict()`` of a model with both ``fc`` and ``module.fc`` was refused by a strict load
  (one name matched as it is, so nothing was unprefixed) and a ``strict=False`` load read the wrong tensors.
- Names: a partial match (a layer added since) built a set of all names per tensor (quadratic), and the
  LoRA hint scanned every name per wrapped layer (17 million calls for 1,000 layers); both count linearly now.
"""

from __future__ import annotations

import builtins
import sys
import warnings

import pytest
import torch
from torch import nn

import trainguard as tg


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class _EMA(nn.Module):  # a wrapper whose own child is named `module` (timm's ModelEmaV2)
    def __init__(self):
        super().__init__()
        self.module = _Inner()


class _Both(nn.Module):  # `fc` beside a child `module` holding an `fc`
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.module = _Inner()


def _fill(model, start):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(start + i)
    return model


def _ddp_sd(model):  # what DistributedDataParallel(model).state_dict() holds
    return {"module." + k: v.clone() for k, v in model.state_dict().items()}


def test_ddp_state_dict_of_a_model_with_a_child_named_module_takes_its_own_names(tmp_path):
    path = str(tmp_path / "a")
    source = _fill(_EMA(), 7)
    tg.save(path, {"model": _ddp_sd(source)})
    ema = _fill(_EMA(), 0)
    got = tg.load(path, {"model": ema})  # before: refused (module.module.fc.weight stripped to fc.weight)
    assert got.missing_keys == got.unexpected_keys == []
    assert torch.equal(ema.module.fc.weight, source.module.fc.weight)
    both = _fill(_Both(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tg.load(path, {"model": both}, strict=False)
    assert torch.equal(both.module.fc.weight, source.module.fc.weight)  # before: read into both.fc
    assert torch.equal(both.fc.weight, torch.zeros(2, 2))
    assert got.missing_keys == ["model/fc.weight", "model/fc.bias"] and got.unexpected_keys == []


def test_ddp_state_dict_where_some_names_match_unprefixed_loads_each_into_its_own(tmp_path):
    path = str(tmp_path / "a")
    source = _fill(_Both(), 7)
    tg.save(path, {"model": _ddp_sd(source)})  # module.fc.*, module.module.fc.*: module.fc.* is also a name of _Both
    dest = _fill(_Both(), 0)
    got = tg.load(path, {"model": dest})  # before: refused; strict=False read source.fc into dest.module.fc
    assert got.missing_keys == got.unexpected_keys == []
    for a, b in zip(dest.state_dict().values(), source.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class _Two(nn.Module):  # a, b and a child `module` holding an `a`
    def __init__(self):
        super().__init__()
        self.a, self.b, self.module = nn.Linear(2, 2), nn.Linear(2, 2), nn.Module()
        self.module.a = nn.Linear(2, 2)


def test_a_name_of_the_module_that_is_also_a_checkpoint_name_is_never_read_twice(tmp_path):
    path = str(tmp_path / "a")
    src = nn.Module()
    src.a, src.b = nn.Linear(2, 2), nn.Linear(2, 2)
    tg.save(path, {"model": _ddp_sd(_fill(src, 7))})  # module.a.*, module.b.*: `module.a.*` is also _Two's
    dest = _fill(_Two(), 0)
    with pytest.raises(tg.StateMismatchError):  # refused before anything is read, not read into two places
        tg.load(path, {"model": dest})
    assert all(torch.equal(p, torch.full_like(p, i)) for i, p in enumerate(dest.parameters()))


class _CountingSet(set):
    added = 0

    def __init__(self, items=()):
        items = list(items)
        _CountingSet.added += len(items)
        super().__init__(items)


def test_a_prefixed_partial_match_costs_linear_work(monkeypatch):
    from trainguard.stateful import ModuleAdapter

    n = 2000
    refs = [f"model/module.l{i}.weight" for i in range(n)]
    dest = {f"model/l{i}.weight": torch.zeros(1) for i in range(n + 1)}  # a layer added since the save
    monkeypatch.setattr(builtins, "set", _CountingSet)
    _CountingSet.added = 0
    out = ModuleAdapter.unwrapped_names(refs, dest, "model/")
    monkeypatch.undo()
    assert out["model/module.l5.weight"] is dest["model/l5.weight"] and "model/l2000.weight" in out
    assert _CountingSet.added < 10 * n, _CountingSet.added  # before: a set of all n names per tensor (4 million)


def test_the_lora_hint_for_every_layer_wrapped_costs_linear_work():
    from trainguard.prefixhint import wrap_hints

    layers = 400
    saved = [f"model/l{i}.{k}" for i in range(layers) for k in ("weight", "bias")]
    state = [f"model/l{i}.base.{k}" for i in range(layers) for k in ("weight", "bias")]
    state += [f"model/l{i}.{k}" for i in range(layers) for k in ("A", "B")]
    calls = [0]

    def count(frame, event, arg):
        if event == "c_call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        text = wrap_hints(state, saved)
    finally:
        sys.setprofile(None)
    assert "'l0' -> 'l0.base' (2 tensors)" in text and "the adapters?" in text
    assert calls[0] < 40 * (len(saved) + len(state)), calls[0]  # before: 2.7 million (a scan of all names per layer)
