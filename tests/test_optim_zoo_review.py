"""Optimizers, LR schedulers and GradScaler across a resume: what ``OptimizerAdapter`` (stateful.py)
gives ``torch.optim.Optimizer.load_state_dict`` when the optimizer is rebuilt differently."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg


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
    with pytest.raises(tg.CheckpointError, match=rf"entry 'optim': .*{saved.__name__} optimizer.*is a {rebuilt.__name__}"):
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
