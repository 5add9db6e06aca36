"""Optimizers, schedulers and scalers of real training code across a save and a resume
(session 19's review): the state after the load equals the saved one, Python types included,
and the next steps are bit-identical to the run that was not interrupted."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg

_S = torch.optim.lr_scheduler


def _same(a, b, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, compared recursively with their types (int is not float,
    a float is not a tensor, a deque is not a list)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in _same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple, collections.deque)):
        if len(a) != len(b) or getattr(a, "maxlen", None) != getattr(b, "maxlen", None):
            return [f"{path}: {a!r} vs {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}/{i}")]
    if callable(a):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


class _Window(_S.LRScheduler):
    """A user's scheduler that keeps a window of recent values (a deque) and a factor from numpy."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.window: collections.deque = collections.deque(maxlen=3)
        self.decay = np.float64(0.9)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        self.window.append(self.last_epoch * 0.5)
        scale = self.decay ** (sum(self.window) / len(self.window))
        return [g["initial_lr"] * scale for g in self.optimizer.param_groups]


def _window_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": opt, "sched": _Window(opt), "rng": tg.RNGState()}


def _window_step(st: dict) -> None:
    st["optim"].zero_grad()
    st["model"](torch.randn(5, 6)).square().mean().backward()
    st["optim"].step()
    st["sched"].step()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_scheduler_keeping_a_deque_and_a_numpy_float_resumes_with_both(tmp_path, async_save) -> None:
    """A user scheduler subclass whose attributes (all of its ``__dict__`` is its state_dict) hold a
    ``collections.deque(maxlen=3)``: the first save raised UnsupportedValueError. It is stored as a
    list and loaded back as a deque with the fresh scheduler's maxlen; a numpy.float64 attribute,
    stored as a float, comes back as a numpy.float64."""
    ref = _window_state(0)
    for _ in range(8):
        _window_step(ref)
    run = _window_state(0)
    for _ in range(4):
        _window_step(run)
    saved = copy.deepcopy(run["sched"].state_dict())
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=async_save) as mgr:
        mgr.save(4, run)
    new = _window_state(1)
    assert _same(saved, new["sched"].state_dict())  # differs before the load
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore(new) == 4
    assert _same(saved, new["sched"].state_dict()) == []
    assert type(new["sched"].window) is collections.deque and new["sched"].window.maxlen == 3
    assert type(new["sched"].decay) is np.float64
    for _ in range(4):
        _window_step(new)
    assert _same(ref["sched"].state_dict(), new["sched"].state_dict()) == []
    assert _same(ref["optim"].state_dict(), new["optim"].state_dict()) == []
    assert all(torch.equal(a, b) for a, b in zip(ref["model"].parameters(), new["model"].parameters()))


def test_a_deque_loaded_into_nothing_is_a_list_and_one_in_an_optimizer_is_refused(tmp_path) -> None:
    """Where no deque waits at the place (a load into nothing) the value is a list; an optimizer's
    state is rebuilt by torch's ``load_state_dict``, which would keep a list without its maxlen:
    a deque there is refused at save time, naming it, before anything is written."""
    tg.save(tmp_path / "a", {"extra": {"hist": collections.deque([1, 2.5], maxlen=4)}})
    out = {"extra": None}
    tg.load(tmp_path / "a", out)
    assert out["extra"] == {"hist": [1, 2.5]} and type(out["extra"]["hist"]) is list
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["hist"] = collections.deque([1.0], maxlen=2)
    with pytest.raises(tg.UnsupportedValueError, match="optim/state/weight/hist: value of type collections.deque"):
        tg.save(tmp_path / "b", {"model": model, "optim": opt})
    assert not (tmp_path / "b").exists()


class _Config:
    warmup = 3


class _WarmupFromConfig:
    """An lr_lambda object that keeps its configuration object: LambdaLR.state_dict() saves its __dict__."""

    def __init__(self, cfg: object) -> None:
        self.cfg = cfg

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / getattr(self.cfg, "warmup", 3))


@pytest.mark.parametrize("held", ["config", "optimizer"])
def test_a_lambda_object_holding_an_object_is_refused_saying_what_to_change_in_it(tmp_path, held) -> None:
    """LambdaLR saves every attribute of an lr_lambda that is an object. One that held its config
    object was refused with advice that does not apply to an attribute ("wrap other objects in a
    class with state_dict()"), one that held the optimizer with "give it its own key, e.g.
    state['sched.lr_lambdas.0.cfg']"; the error now says what to change in the lambda or the
    scheduler, and nothing is written."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = _S.LambdaLR(opt, _WarmupFromConfig(_Config() if held == "config" else opt))
    with pytest.raises(tg.UnsupportedValueError) as e:
        tg.save(tmp_path / "step-1", {"model": model, "optim": opt, "sched": sched})
    msg = str(e.value)
    assert msg.startswith("sched/lr_lambdas/0/cfg: ") and "self.warmup = cfg.warmup" in msg and "functools.partial" in msg
    assert "wrap other objects" not in msg and "its own key" not in msg
    assert not (tmp_path / "step-1").exists()


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


_UNFREEZE = 3


def _unfreezing_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = _Backbone()
    model.backbone.requires_grad_(False)
    # user keys in the group: a name, a list holding a None, a None, a nested dict with a tuple
    head = {"params": model.head.parameters(), "name": "head", "extra": [1, 2.5, None], "none": None, "nested": {"b": (1, 2)}}
    opt = torch.optim.AdamW([head], lr=1e-2)
    return {"model": model, "optim": opt, "rng": tg.RNGState()}


def _unfreeze(st: dict) -> None:
    st["model"].backbone.requires_grad_(True)
    st["optim"].add_param_group({"params": st["model"].backbone.parameters(), "lr": 1e-3, "name": "backbone"})


def _unfreezing_step(st: dict, step: int) -> None:
    if step == _UNFREEZE:
        _unfreeze(st)
    st["optim"].zero_grad()
    st["model"](torch.randn(5, 6)).square().mean().backward()
    st["optim"].step()


def test_a_group_added_during_training_must_be_added_before_the_load_and_the_refusal_says_so(tmp_path) -> None:
    """Progressive unfreezing: ``add_param_group`` at step 3, a save at step 5. A resumed process
    that builds the optimizer as at the start of the run was refused with "the checkpoint has 2
    parameter group(s), the optimizer 1; build the optimizer with the same groups", naming neither
    the group nor add_param_group; it now names the group's parameters and its "name", and says to
    add it again before the load. Doing so (``mgr.latest_step()`` tells whether to) resumes
    bit-identically, with the groups' user keys as saved."""
    ref = _unfreezing_state(0)
    for k in range(8):
        _unfreezing_step(ref, k)
    run = _unfreezing_state(0)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5)) as mgr:
        for k in range(6):
            _unfreezing_step(run, k)
            mgr.save(k, run)
    saved = copy.deepcopy(run["optim"].state_dict())
    forgot = _unfreezing_state(1)
    before = copy.deepcopy(forgot["model"].state_dict())
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5)) as mgr:
        with pytest.raises(tg.CheckpointError) as e:
            mgr.restore(forgot)
    msg = str(e.value)
    assert "the checkpoint has 2 parameter group(s), the optimizer 1" in msg
    assert "group 1 ('backbone') holds ['backbone.weight', 'backbone.bias']" in msg and "add_param_group" in msg
    assert _same(before, forgot["model"].state_dict()) == []  # refused before anything was read
    new = _unfreezing_state(1)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5)) as mgr:
        if (mgr.latest_step() or -1) >= _UNFREEZE:
            _unfreeze(new)
        assert mgr.restore(new) == 5
    assert _same(saved, new["optim"].state_dict()) == []
    for k in range(6, 8):
        _unfreezing_step(new, k)
    assert _same(ref["optim"].state_dict(), new["optim"].state_dict()) == []
    assert _same(ref["model"].state_dict(), new["model"].state_dict()) == []


def test_an_optimizer_with_a_group_the_checkpoint_has_not_yet_is_refused_naming_it(tmp_path) -> None:
    """The reverse: the resumed optimizer already holds the group the run adds later than the
    checkpoint's step."""
    run = _unfreezing_state(0)
    for k in range(2):
        _unfreezing_step(run, k)
    tg.save(tmp_path / "step-1", run)
    new = _unfreezing_state(1)
    _unfreeze(new)
    with pytest.raises(tg.CheckpointError, match=r"the optimizer's group 1 \('backbone'\) holds \['backbone.weight', "
                       r"'backbone.bias'\], which no group of the checkpoint holds; .*added after the load, at that step"):
        tg.load(tmp_path / "step-1", new)


def _sched_state(seed: int, make) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": opt, "sched": make(opt)}


@pytest.mark.parametrize("saved,resumed", [
    (lambda o: _S.OneCycleLR(o, max_lr=0.1, total_steps=20), lambda o: _S.CosineAnnealingLR(o, T_max=20)),
    (lambda o: _S.ReduceLROnPlateau(o, mode="max"), lambda o: _S.StepLR(o, 5)),
    (lambda o: _S.SequentialLR(o, [_S.LinearLR(o, 0.1, total_iters=2), _S.ExponentialLR(o, 0.9)], [2]),
     lambda o: _S.SequentialLR(o, [_S.LinearLR(o, 0.1, total_iters=2), _S.CosineAnnealingLR(o, 10)], [2])),
])
def test_a_scheduler_of_another_class_is_refused_before_anything_is_read(tmp_path, saved, resumed) -> None:
    """A scheduler's load_state_dict is ``__dict__.update``: a OneCycleLR's state loaded into a
    CosineAnnealingLR without a word, which then annealed from OneCycleLR's base_lrs (max_lr / 25).
    The class is now saved beside the entry and another one refused, naming both, before the
    model or the optimizer is read; the same class loads."""
    run = _sched_state(0, saved)
    for _ in range(3):
        run["optim"].step()
        run["sched"].step(1.0) if isinstance(run["sched"], _S.ReduceLROnPlateau) else run["sched"].step()
    tg.save(tmp_path / "step-3", run)
    new = _sched_state(1, resumed)
    before = copy.deepcopy({"model": new["model"].state_dict(), "sched": new["sched"].state_dict()})
    with pytest.raises(tg.CheckpointError, match=r"entry 'sched': the checkpoint holds the state of a \S+ scheduler, "
                       r"the state's scheduler is a \S+; .*Build a \S+ as at save time"):
        tg.load(tmp_path / "step-3", new)
    assert _same(before, {"model": new["model"].state_dict(), "sched": new["sched"].state_dict()}) == []
    same = _sched_state(1, saved)
    tg.load(tmp_path / "step-3", same)
    assert _same(run["sched"].state_dict(), same["sched"].state_dict()) == []


def test_the_frozen_warning_still_names_the_callers_line(tmp_path) -> None:
    """The requires_grad check runs one call deeper now (schedclass.check_entries): its warning
    must still point at the caller of tg.load."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg.save(tmp_path / "a", {"model": model, "optim": opt})
    model.weight.requires_grad_(False)
    with pytest.warns(UserWarning, match="differ in requires_grad") as caught:
        tg.load(tmp_path / "a", {"model": model, "optim": opt})
    assert caught[0].filename == __file__
