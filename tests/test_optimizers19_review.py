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
    with pytest.raises(tg.CheckpointError, match=r"entry 'sched': the checkpoint holds the state of an? \S+ scheduler, "
                       r"the state's scheduler is an? \S+; .*Build an? \S+ as at save time"):
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


class _Sparse(nn.Module):
    """A sparse embedding and dense layers; ``late`` gets its first gradient at step 6."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=sparse)
        self.fc1, self.fc2, self.late = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(3, 3)

    def forward(self, idx: torch.Tensor, step: int) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(self.emb(idx))))
        return self.late(h) if step >= 6 else h


class _Scale:
    """A CyclicLR scale_fn that is an object: CyclicLR saves its __dict__."""

    def __init__(self) -> None:
        self.base, self.calls = 0.7, 0

    def __call__(self, x: float) -> float:
        self.calls += 1
        return self.base**x


class _Warm:
    """A LambdaLR lr_lambda that is an object with counters."""

    def __init__(self) -> None:
        self.n, self.calls, self.hist = 4, 0, [0.5]

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        return min(1.0, (epoch + 1) / self.n)


_ZOO19 = {
    "lbfgs": (lambda m: torch.optim.LBFGS(m.parameters(), lr=1, history_size=3, max_iter=4, line_search_fn="strong_wolfe"), None),
    "asgd-poly": (lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=2), lambda o: _S.PolynomialLR(o, total_iters=6, power=2.0)),
    "nadam-plateau-max": (lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
                          lambda o: _S.ReduceLROnPlateau(o, mode="max", patience=0, cooldown=1, factor=0.5)),
    "amsgrad-warm-restarts": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
                              lambda o: _S.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2)),
    "nesterov-cyclic-object": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                               lambda o: _S.CyclicLR(o, 1e-3, 1e-1, step_size_up=3, scale_fn=_Scale(), scale_mode="cycle")),
    "sparse-adam-adamw-lambda-object": (None, lambda o: _S.LambdaLR(o, _Warm())),
}


def _zoo19_state(name: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = _Sparse(sparse=name.startswith("sparse"))
    make_opt, make_sched = _ZOO19[name]
    st: dict = {"model": model, "rng": tg.RNGState()}
    if make_opt is None:  # SparseAdam for the embedding, AdamW for the rest: two optimizer entries
        st["sparse"] = torch.optim.SparseAdam(list(model.emb.parameters()), lr=1e-2)
        st["optim"] = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("emb")], lr=1e-2)
    else:
        st["optim"] = make_opt(model)
    if make_sched is not None:
        st["sched"] = make_sched(st["optim"])
    # the overflows at steps 1 and 2 skip those steps and halve the scale twice
    st["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backoff_factor=0.5)
    return st


def _zoo19_step(st: dict, k: int) -> None:
    model, opt, scaler = st["model"], st["optim"], st["scaler"]
    idx = torch.randint(0, 20, (7,))
    opts = [o for o in (st.get("sparse"), opt) if o is not None]
    if isinstance(opt, torch.optim.LBFGS):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(idx, k).square().mean()
            loss.backward()
            return loss

        opt.step(closure)
    else:
        for o in opts:
            o.zero_grad()
        loss = model(idx, k).square().mean()
        scaler.scale(loss * float("inf") if k in (1, 2) else loss).backward()
        for o in opts:
            scaler.step(o)
        scaler.update()
    sched = st.get("sched")
    if isinstance(sched, _S.ReduceLROnPlateau):
        sched.step([1.0, 0.5, 0.7, 0.9, 0.3, 0.2, 0.4, 0.6, 0.8, 0.1][k])
    elif isinstance(sched, _S.CosineAnnealingWarmRestarts):
        for j in range(3):
            sched.step(k + (j + 1) / 3)  # fractional epochs: three iterations per step
    elif sched is not None:
        sched.step()


def _entries(st: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) for k, v in st.items() if k != "rng"}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(_ZOO19))
def test_optimizers_schedulers_and_scaler_resume_with_their_types_and_bit_identically(tmp_path, name, async_save) -> None:
    """LBFGS (lists of tensors, ints, floats), SparseAdam beside AdamW over a parameter that gets
    its first gradient after the save, ASGD, NAdam, amsgrad, nesterov momentum; ReduceLROnPlateau
    in mode max, warm restarts stepped by fractional epochs, CyclicLR and LambdaLR with callable
    objects; a GradScaler that skipped steps on inf gradients. What held in session 19's review:
    the state after the load equals the saved one, types included, and 4 more steps equal the run
    that was not interrupted."""
    ref = _zoo19_state(name, 0)
    for k in range(10):
        _zoo19_step(ref, k)
    run = _zoo19_state(name, 0)
    for k in range(6):
        _zoo19_step(run, k)
    saved = _entries(run)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=async_save) as mgr:
        mgr.save(6, run)
    new = _zoo19_state(name, 1)
    assert _same(saved, _entries(new))
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore(new) == 6
    assert _same(saved, _entries(new)) == []
    for k in range(6, 10):
        _zoo19_step(new, k)
    assert _same(_entries(ref), _entries(new)) == []


def _ddp_state(kind: str, seed: int) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    net = _Sparse(sparse=kind == "sparse")
    model = DistributedDataParallel(net)
    st: dict = {"model": model, "rng": tg.RNGState()}
    if kind == "lbfgs":
        st["optim"] = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=2, max_iter=2)
    else:
        st["sparse"] = torch.optim.SparseAdam(list(net.emb.parameters()), lr=1e-2)
        st["optim"] = torch.optim.AdamW([p for n, p in net.named_parameters() if not n.startswith("emb")], lr=1e-2)
        st["scaler"] = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return st


def _ddp_step(st: dict, k: int, rank: int) -> None:
    model, opt = st["model"], st["optim"]
    idx = torch.randint(0, 20, (7,), generator=torch.Generator().manual_seed(1000 * rank + k))  # each rank its batch
    if isinstance(opt, torch.optim.LBFGS):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(idx, 6).square().mean()
            loss.backward()
            return loss

        opt.step(closure)
        return
    scaler = st["scaler"]
    for o in (st["sparse"], opt):
        o.zero_grad()
    loss = model(idx, 6).square().mean()
    scaler.scale(loss * float("inf") if k == 1 else loss).backward()
    for o in (st["sparse"], opt):
        scaler.step(o)
    scaler.update()


def _ddp_rank(rank: int, world: int, root: str, kind: str) -> tuple[list[str], list[str]]:
    ref = _ddp_state(kind, 0)
    for k in range(6):
        _ddp_step(ref, k, rank)
    run = _ddp_state(kind, 0)
    for k in range(3):
        _ddp_step(run, k, rank)
    saved = _entries(run)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=kind == "sparse") as mgr:
        mgr.save(3, run)
    new = _ddp_state(kind, 1)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore(new) == 3
    after_load = _same(saved, _entries(new))
    for k in range(3, 6):
        _ddp_step(new, k, rank)
    return after_load, _same(_entries(ref), _entries(new))


@pytest.mark.parametrize("kind", ["lbfgs", "sparse"])
def test_lbfgs_and_sparse_adam_under_ddp_resume_bit_identically_on_both_ranks(tmp_path, kind) -> None:
    """2 gloo ranks, DDP: LBFGS (its state on one parameter, lists of tensors), and SparseAdam for a
    sparse embedding beside AdamW with a ShardedGradScaler that skipped a step, saved async: each
    rank writes part of the shared entries and loads all of them. LBFGS keeps each rank's own
    loss in ``prev_loss`` (a float; DDP averages gradients, not losses): the checkpoint holds rank 0's
    for both, as for every JSON value of a shared entry, and LBFGS overwrites it before it reads it."""
    from dist_helper import run_ranks

    res = run_ranks(_ddp_rank, 2, str(tmp_path), kind, timeout=120)
    for r in res:
        after_load, after_steps = r.value
        expected = [] if kind == "sparse" or r.rank == 0 else ["/optim/state/0/prev_loss: "]
        assert [d[: len(e)] for d, e in zip(after_load, expected)] == expected and len(after_load) == len(expected), (r.rank, after_load)
        assert after_steps == [], (r.rank, after_steps)
