"""Optimizers, LR schedulers and GradScaler across a resume: what ``OptimizerAdapter`` (stateful.py)
gives ``torch.optim.Optimizer.load_state_dict`` when the optimizer is rebuilt differently."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import async_save


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _stepped(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    model(torch.randn(2, 3)).sum().backward()
    opt.step()


def test_param_names_follow_the_parameters_when_the_order_changed(tmp_path):
    # An optimizer built from named_parameters() (torch >= 2.6) keeps "param_names" beside
    # "params" in each group; trainguard matches the state by name, so a rebuilt optimizer may list
    # its parameters in another order. Its names must still describe its parameters.
    m = _model()
    opt = torch.optim.Adam(m.named_parameters(), lr=1e-2)
    _stepped(opt, m)
    tg.save(tmp_path / "step-1", {"model": m, "optim": opt})
    m2 = _model()
    opt2 = torch.optim.Adam(list(reversed(list(m2.named_parameters()))), lr=1e-2)
    tg.load(tmp_path / "step-1", {"model": m2, "optim": opt2})
    names = {id(p): n for n, p in m2.named_parameters()}
    group = opt2.param_groups[0]
    assert group["param_names"] == [names[id(p)] for p in group["params"]]
    for p in group["params"]:
        assert torch.equal(opt2.state[p]["exp_avg"], opt.state[dict(m.named_parameters())[names[id(p)]]]["exp_avg"])


@pytest.mark.parametrize(
    ("saved", "rebuilt"),
    [
        (torch.optim.Adam, torch.optim.RAdam),  # same state keys: trained on silently before
        (torch.optim.Adam, torch.optim.SGD),  # loaded, then KeyError 'momentum' at the first step()
        (torch.optim.SGD, torch.optim.Adam),  # "refused the saved state: 'step'"
    ],
)
def test_another_optimizer_class_is_refused_naming_both(tmp_path, saved, rebuilt):
    m = _model()
    opt = saved(m.parameters(), lr=1e-2)
    _stepped(opt, m)
    tg.save(tmp_path / "step-1", {"model": m, "optim": opt})
    m2 = _model()
    opt2 = rebuilt(m2.parameters(), lr=1e-3)
    with pytest.raises(tg.CheckpointError, match=rf"entry 'optim': .*{saved.__name__} optimizer.*is an? {rebuilt.__name__}"):
        tg.load(tmp_path / "step-1", {"model": m2, "optim": opt2})
    assert not opt2.state and opt2.param_groups[0]["lr"] == 1e-3  # nothing of the checkpoint went in
    # The way out the message names: the optimizer left out, strict=False.
    tg.load(tmp_path / "step-1", {"model": m2}, strict=False)
    assert torch.equal(m2[0].weight, m[0].weight)


def test_optimizer_loads_when_a_module_entry_was_added_or_removed(tmp_path):
    # Optimizer state is keyed "0.weight" when the state holds one module and "model.0.weight"
    # when it holds several: adding an EMA model to the state of a running job (or dropping one)
    # must not make its checkpoints unloadable into the same optimizer.
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    _stepped(opt, m)
    tg.save(tmp_path / "one", {"model": m, "optim": opt})
    tg.save(tmp_path / "two", {"model": m, "optim": opt, "ema": torch.optim.swa_utils.AveragedModel(m)})
    for saved, with_ema in (("one", True), ("two", False)):
        m2 = _model()
        opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
        state = {"model": m2, "optim": opt2}
        if with_ema:
            state["ema"] = torch.optim.swa_utils.AveragedModel(m2)
        tg.load(tmp_path / saved, state, strict=False)  # the entry "ema" is missing or unexpected
        assert opt2.param_groups[0]["lr"] == 1e-2
        for p, q in zip(m.parameters(), m2.parameters(), strict=True):
            assert torch.equal(opt2.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
            assert torch.equal(opt2.state[q]["step"], opt.state[p]["step"])


def test_load_into_the_state_waits_for_an_async_save_still_copying_it(tmp_path, monkeypatch):
    # Rolling the live state back (tg.load of an older checkpoint) while an async save of it is in
    # flight: the save must commit the state of its call, not the bytes the load writes in place.
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    _stepped(opt, m)
    tg.save(tmp_path / "old", {"model": m, "optim": opt})
    old = {k: v.clone() for k, v in m.state_dict().items()}
    _stepped(opt, m)
    at_call = {k: v.clone() for k, v in m.state_dict().items()}
    gate = threading.Event()  # the save's background copies (parameters, Adam state) wait for it
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
    h = tg.save(tmp_path / "new", {"model": m, "optim": opt}, async_=True)
    threading.Thread(target=lambda: (h.waiting.wait(60), gate.set()), daemon=True).start()  # opens it for a waiter
    tg.load(tmp_path / "old", {"model": m, "optim": opt})
    gate.set()
    h.result(timeout=60)
    assert all(torch.equal(v, old[k]) for k, v in m.state_dict().items())  # the load rolled it back
    got = _model()
    tg.load(tmp_path / "new", {"model": got}, only=["model"])
    for k, v in got.state_dict().items():
        assert torch.equal(v, at_call[k]), k


def test_other_parameter_groups_are_refused_before_anything_is_read(tmp_path):
    # A live optimizer (with state) and its model: a refused load must leave both as they were,
    # not the model and the optimizer's moments loaded and the rest not.
    m = _model()
    opt = torch.optim.Adam([{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 0.1}])
    _stepped(opt, m)
    tg.save(tmp_path / "step-1", {"model": m, "optim": opt})
    m2 = _model()
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    for _ in range(2):
        _stepped(opt2, m2)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    moments = {p: opt2.state[p]["exp_avg"].clone() for p in m2.parameters()}
    with pytest.raises(tg.CheckpointError, match=r"entry 'optim': the checkpoint has 2 parameter group\(s\), the optimizer 1"):
        tg.load(tmp_path / "step-1", {"model": m2, "optim": opt2})
    assert all(torch.equal(v, before[k]) for k, v in m2.state_dict().items())
    assert all(torch.equal(opt2.state[p]["exp_avg"], v) for p, v in moments.items())


class _Net(nn.Module):
    """A sparse embedding, two trained layers, a frozen one and one that never gets a gradient."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=sparse)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.fc2(torch.tanh(self.fc1(self.emb(idx)))))


_S = torch.optim.lr_scheduler
_ZOO = {
    "lbfgs-sequential": (lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, history_size=3, max_iter=4),
                         lambda o: _S.SequentialLR(o, [_S.LinearLR(o, 0.1, total_iters=3), _S.ExponentialLR(o, 0.9)], [3])),
    "nadam-plateau": (lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
                      lambda o: _S.ReduceLROnPlateau(o, patience=1, cooldown=1, factor=0.5)),
    "adam-fused-tensor-lr-onecycle": (lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2), amsgrad=True, fused=True),
                                      lambda o: _S.OneCycleLR(o, max_lr=0.1, total_steps=20)),
    "sgd-groups-cyclic": (lambda m: torch.optim.SGD([{"params": m.emb.parameters(), "lr": 0.05},
                                                     {"params": [*m.fc1.parameters(), *m.fc2.parameters(), *m.unused.parameters()]}],
                                                    lr=0.1, momentum=0.9, nesterov=True),
                          lambda o: _S.CyclicLR(o, [1e-3, 1e-4], [1e-1, 1e-2], step_size_up=3, mode="exp_range", gamma=0.9)),
    "asgd-warm-restarts": (lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=2),
                           lambda o: _S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2)),
    "sparse-adam-multiplicative": (lambda m: torch.optim.SparseAdam(list(m.emb.parameters()), lr=1e-2),
                                   lambda o: _S.MultiplicativeLR(o, lambda s: 0.95)),
}


def _zoo_state(name: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = _Net(sparse=name.startswith("sparse"))
    make_opt, make_sched = _ZOO[name]
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return {"model": model, "optim": opt, "sched": make_sched(opt), "scaler": scaler, "rng": tg.RNGState()}


def _zoo_step(st: dict, k: int) -> None:
    model, opt, sched, scaler = st["model"], st["optim"], st["sched"], st["scaler"]
    idx = torch.randint(0, 10, (5,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(idx).square().mean()
        loss.backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        opt.step(closure)
    else:
        opt.zero_grad()
        scaler.scale(model(idx).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    sched.step(1.0 if k % 3 else 0.5) if isinstance(sched, _S.ReduceLROnPlateau) else sched.step()


@pytest.mark.parametrize("name", sorted(_ZOO))
def test_resume_is_bit_identical_across_optimizers_and_schedulers(tmp_path, name):
    ref = _zoo_state(name, 0)
    for k in range(10):
        _zoo_step(ref, k)
    run = _zoo_state(name, 0)
    for k in range(5):
        _zoo_step(run, k)
    tg.save(tmp_path / "step-5", run)
    new = _zoo_state(name, 1)  # other initial weights and RNG: everything must come from the checkpoint
    tg.load(tmp_path / "step-5", new)
    for k in range(5, 10):
        _zoo_step(new, k)
    for a, b in zip(ref["model"].state_dict().values(), new["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    want, got = ref["optim"].state_dict(), new["optim"].state_dict()
    assert want["state"].keys() == got["state"].keys()
    for i, s in want["state"].items():
        for key, v in s.items():
            vs, gs = (v, got["state"][i][key]) if isinstance(v, list) else ([v], [got["state"][i][key]])
            for x, y in zip(vs, gs, strict=True):
                assert torch.equal(x, y) if torch.is_tensor(x) else x == y, (i, key)
    assert [float(x) for x in ref["sched"]._last_lr] == [float(x) for x in new["sched"]._last_lr]
    assert ref["scaler"].state_dict() == new["scaler"].state_dict()


def test_an_lr_set_from_numpy_is_saved_as_a_float(tmp_path):
    """A manual schedule ``g["lr"] = base * np.cos(...)`` leaves a numpy.float64 (a float
    subclass) in the param group: the first save raised UnsupportedValueError, stopping the run at
    its first checkpoint. Other numpy values are still refused."""
    import numpy as np

    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = 0.1 * np.cos(np.float64(0.5))
    tg.save(tmp_path / "a", {"model": m, "optim": opt})
    opt2 = torch.optim.SGD(m.parameters(), lr=1.0)
    tg.load(tmp_path / "a", {"model": m, "optim": opt2})
    assert opt2.param_groups[0]["lr"] == 0.1 * np.cos(0.5) and type(opt2.param_groups[0]["lr"]) is float
    with pytest.raises(tg.UnsupportedValueError, match="numpy"):
        tg.save(tmp_path / "b", {"x": {"v": np.float32(1.5)}})
