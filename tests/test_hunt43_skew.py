"""Resuming after the code changed between save and load (hunt 43, "skew"): a refused load leaves
the whole state as it was, and a ``strict=False`` load keeps a reshaped parameter's optimizer
state whole."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()


def _snapshot(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = {n: t.detach().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t)
                        for n, t in value.state_dict().items()}
        elif isinstance(value, tg.RNGState):
            out[key] = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
        else:
            out[key] = copy.deepcopy(value.state_dict())
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _saved(tmp_path, extra: dict) -> tuple[str, dict]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optim, 2)
    path = str(tmp_path / "step-000000002")
    tg.save(path, {"model": model, "optim": optim, "rng": tg.RNGState(), "progress": tg.StateDict(step=2), **extra})
    return path, _snapshot({"model": model})


def _fresh_state(extra: dict, order: tuple[str, ...]) -> dict:
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optim, 3)
    random.seed(123)
    state = {"model": model, "optim": optim, "rng": tg.RNGState(), "progress": tg.StateDict(step=0), **extra}
    return {k: state[k] for k in order}


@pytest.mark.parametrize("first", [True, False])
def test_gradscaler_enabled_since_save_refused_before_anything_is_read(tmp_path, first):
    path, _ = _saved(tmp_path, {"scaler": torch.amp.GradScaler("cpu", enabled=False)})
    order = ("model", "optim", "rng", "progress")
    order = ("scaler", *order) if first else (*order, "scaler")
    state = _fresh_state({"scaler": torch.amp.GradScaler("cpu", init_scale=1024.0)}, order)
    before = _snapshot(state)
    with pytest.raises(tg.CheckpointError, match="entry 'scaler'.*GradScaler was disabled"):
        tg.load(path, state)
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []
    # strict=False still loads the rest and keeps the fresh scaler, with a warning
    with pytest.warns(UserWarning, match="starts fresh"):
        tg.load(path, state, strict=False)
    assert state["progress"]["step"] == 2 and state["scaler"].get_scale() == 1024.0


def test_sampler_of_another_dataset_refused_before_anything_is_read(tmp_path):
    sampler = tg.ResumableSampler(100, seed=1)
    sampler.advance(10)
    path, _ = _saved(tmp_path, {"data": sampler})
    state = _fresh_state({"data": tg.ResumableSampler(120, seed=1)}, ("rng", "model", "optim", "progress", "data"))
    before = _snapshot(state)
    with pytest.raises(tg.CheckpointError, match="entry 'data': ResumableSampler: checkpoint has num_samples=100"):
        tg.load(path, state)
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []


def test_sampler_state_into_iterable_refused_before_anything_is_read(tmp_path):
    path, _ = _saved(tmp_path, {"data": tg.ResumableSampler(100, seed=1)})
    state = _fresh_state({"data": tg.ResumableIterable(lambda epoch: range(10))}, ("model", "optim", "progress", "data"))
    before = _snapshot(state)
    with pytest.raises(tg.CheckpointError, match="entry 'data': ResumableIterable: the saved state is a ResumableSampler"):
        tg.load(path, state)
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []


def test_manager_restore_refused_by_sampler_leaves_state_as_it_was(tmp_path):
    sampler = tg.ResumableSampler(50)
    _saved(tmp_path, {"data": sampler})
    state = _fresh_state({"data": tg.ResumableSampler(60)}, ("model", "optim", "progress", "data"))
    before = _snapshot(state)
    with tg.CheckpointManager(str(tmp_path), save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match="num_samples=50"):
            mgr.restore(state)
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []


def test_reshaped_parameter_keeps_its_optimizer_state_whole_with_strict_false(tmp_path):
    class Net(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(4, width), nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.fc(x))

    torch.manual_seed(0)
    model = Net(2)
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim, 2)
    path = str(tmp_path / "step-000000002")
    tg.save(path, {"model": model, "optim": optim})
    saved_bias = optim.state[model.head.bias]["exp_avg"].clone()

    torch.manual_seed(1)
    wide = Net(3)  # fc and head.weight reshaped; head.bias not
    wopt = torch.optim.AdamW(wide.parameters())
    _train(wide, wopt, 3)  # an optimizer that has state already
    kept = {k: v.clone() for k, v in wopt.state[wide.fc.weight].items()}
    with pytest.warns(UserWarning, match="keep their current values"):
        tg.load(path, {"model": wide, "optim": wopt}, strict=False)
    now = wopt.state[wide.fc.weight]
    assert float(now["step"]) == 3.0  # was the checkpoint's 2 beside this run's moments
    assert all(torch.equal(now[k], kept[k]) for k in kept)
    assert torch.equal(wopt.state[wide.head.bias]["exp_avg"], saved_bias)
    assert float(wopt.state[wide.head.bias]["step"]) == 2.0

    fresh = Net(3)  # a fresh optimizer: no state for a reshaped parameter, the rest loaded
    fopt = torch.optim.AdamW(fresh.parameters())
    with pytest.warns(UserWarning, match="keep their current values"):
        tg.load(path, {"model": fresh, "optim": fopt}, strict=False)
    assert fresh.fc.weight not in fopt.state and fresh.head.bias in fopt.state
    _train(fresh, fopt, 1)
    assert float(fopt.state[fresh.fc.weight]["step"]) == 1.0 and float(fopt.state[fresh.head.bias]["step"]) == 3.0


@pytest.mark.parametrize("groups", ["fewer", "split"])
def test_imported_index_keyed_optimizer_of_other_groups_refused_before_anything_is_read(tmp_path, groups):
    from trainguard.convert import convert

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters())
    _train(model, optim, 2)
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "w.pt")
    path = str(tmp_path / "imported" / "step-000000000")
    convert(str(tmp_path / "w.pt"), path)

    torch.manual_seed(1)
    live = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    params = list(live.parameters())
    built = [{"params": params[:3]}] if groups == "fewer" else [{"params": params[:2]}, {"params": params[2:]}]
    lopt = torch.optim.AdamW(built)
    _train(live, lopt, 3)
    state = {"model": live, "optim": lopt}
    before = _snapshot(state)
    with pytest.raises(tg.CheckpointError, match=r"entry 'optim': .*keyed by parameter position.*1 parameter group\(s\) of \[4\]"):
        tg.load(path, state)
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []


def test_powersgd_state_of_another_rank_refused_before_anything_is_read(tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    hs = P.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    hs.iter, hs.p_memory_dict, hs.q_memory_dict = 5, {0: torch.ones(4, 2)}, {0: torch.ones(2, 2)}
    path, _ = _saved(tmp_path, {"comm": hs})
    live = P.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    state = _fresh_state({"comm": live}, ("model", "optim", "rng", "progress", "comm"))
    before = _snapshot({k: v for k, v in state.items() if k != "comm"})
    with pytest.raises(tg.CheckpointError, match="entry 'comm': the PowerSGDState was saved with matrix_approximation_rank=2"):
        tg.load(path, state)
    after = _snapshot({k: v for k, v in state.items() if k != "comm"})
    assert [k for k in before if not _same(before[k], after[k])] == []
    assert live.iter == 0  # was set to the checkpoint's 5 before the refusal


def test_module_wrapped_in_a_new_container_named_in_the_strict_error(tmp_path):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    tg.save(str(tmp_path / "plain" / "step-000000001"), {"model": inner})
    tg.save(str(tmp_path / "wrapped" / "step-000000001"), {"model": nn.Sequential(inner)})

    fresh = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(str(tmp_path / "plain" / "step-000000001"), {"model": nn.Sequential(fresh)})
    assert "each of the checkpoint's 4 tensors under '0.'" in str(e.value)
    assert "strict=False would load none of them" in str(e.value)
    assert sorted(e.value.missing) == ["model/0.0.bias", "model/0.0.weight", "model/0.2.bias", "model/0.2.weight"]
    # the hint's advice works: the inner module loads
    tg.load(str(tmp_path / "plain" / "step-000000001"), {"model": fresh})
    assert torch.equal(fresh[0].weight, inner[0].weight)

    with pytest.raises(tg.StateMismatchError, match=r"the checkpoint holds each of the state's 4 tensors under '0\.'"):
        tg.load(str(tmp_path / "wrapped" / "step-000000001"), {"model": nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))})
    # a plain rename is not taken for a wrapper
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(str(tmp_path / "plain" / "step-000000001"), {"model": nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))})
    assert "new container" not in str(e.value) and "under '" not in str(e.value)


def test_restore_falls_back_past_a_corrupt_checkpoint_holding_state_for_a_parameter_unfrozen_since(tmp_path):
    """Step 1 saved with a frozen layer (no optimizer state for it), step 2 after unfreezing it; step 2 is
    corrupt. The restart's fresh optimizer reads that layer's state into new tensors, never in place: the
    fall back to step 1 was refused ("partly read from a newer checkpoint"), so the run could not resume."""
    import glob
    import warnings

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        return model, torch.optim.AdamW(model.parameters())

    root = str(tmp_path / "run")
    model, optim = build()
    model[0].weight.requires_grad_(False)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        _train(model, optim, 1)
        mgr.save(1, {"model": model, "optim": optim})
        step1 = _snapshot({"model": model, "optim": optim})
        model[0].weight.requires_grad_(True)
        _train(model, optim, 1)
        mgr.save(2, {"model": model, "optim": optim})
    data = sorted(glob.glob(root + "/step-000000002/data-*.bin"))[0]
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(data, "wb").write(bytes(raw))

    model, optim = build()
    model[0].weight.requires_grad_(False)  # the loop's freezing schedule, applied again on resume
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            assert mgr.restore({"model": model, "optim": optim}) == 1
    got = _snapshot({"model": model, "optim": optim})
    assert _same(got["model"], step1["model"]) and _same(got["optim"], step1["optim"])
    assert model[0].weight not in optim.state


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _WithExtra(_Plain):
    """A module that started (or stopped) keeping extra state between save and load."""

    def __init__(self, v: int, tensor: bool) -> None:
        super().__init__()
        self.v, self.tensor = v, tensor

    def get_extra_state(self) -> dict:
        return {"v": self.v, "t": torch.full((2,), float(self.v))} if self.tensor else {"v": self.v}

    def set_extra_state(self, state: dict) -> None:
        self.v = state["v"]


@pytest.mark.parametrize("tensor", [False, True])
@pytest.mark.parametrize("direction", ["added", "removed"])
def test_extra_state_added_or_removed_since_the_save_refused_before_anything_is_read(tmp_path, direction, tensor):
    torch.manual_seed(0)
    saved = _WithExtra(5, tensor) if direction == "removed" else _Plain()
    sopt = torch.optim.AdamW(saved.parameters())
    _train(saved, sopt, 2)
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"progress": tg.StateDict(step=1), "model": saved, "optim": sopt})

    torch.manual_seed(1)
    live = _Plain() if direction == "removed" else _WithExtra(7, tensor)
    lopt = torch.optim.AdamW(live.parameters())
    _train(live, lopt, 3)
    state = {"progress": tg.StateDict(step=0), "model": live, "optim": lopt}
    before = _snapshot(state)
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(path, state)
    assert (e.value.missing if direction == "added" else e.value.unexpected) == ["model/_extra_state"]
    after = _snapshot(state)
    assert [k for k in before if not _same(before[k], after[k])] == []
    tg.load(path, state, strict=False)  # the rest loads; the extra state stays the module's
    assert state["progress"]["step"] == 1 and torch.equal(live.fc.weight, saved.fc.weight)
    assert getattr(live, "v", 7) == 7


def test_parameter_moved_between_groups_is_not_taken_for_a_pipeline_stage(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optim = torch.optim.AdamW([{"params": [model[0].weight, model[0].bias]},
                               {"params": [model[2].weight, model[2].bias], "lr": 0.01}])
    _train(model, optim, 1)
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": model, "optim": optim})
    moved = torch.optim.AdamW([{"params": [model[0].weight]},
                               {"params": [model[0].bias, model[2].weight, model[2].bias], "lr": 0.01}])
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, {"model": model, "optim": moved})
    assert "grouped otherwise: '0.bias' (checkpoint group 0, optimizer group 1)" in str(e.value)
    assert "split_state" not in str(e.value)
    # a parameter really left out: named; since session 56 without the pipeline-stage hint, as the manifest
    # says one process saved it (tests/test_hunt56_review56c.py; rankload.split_hint)
    fewer = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[2].weight, model[2].bias], "lr": 0.01}])
    with pytest.raises(tg.CheckpointError, match=r"\['0\.bias'\], which the optimizer's lacks") as e:
        tg.load(path, {"model": model, "optim": fewer})
    assert "split_state" not in str(e.value)


def test_scheduler_added_since_the_save_warns_when_the_optimizer_takes_another_lr(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim, 1)
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": model, "optim": optim})

    def resumed(start_factor: float):
        m = nn.Linear(4, 2)
        o = torch.optim.AdamW(m.parameters(), lr=0.1)
        s = torch.optim.lr_scheduler.LinearLR(o, start_factor=start_factor, total_iters=4)  # a warmup added
        return o, s, {"model": m, "optim": o, "sched": s}

    optim2, sched, state = resumed(0.5)
    with pytest.warns(UserWarning, match=r"scheduler entry 'sched' is not in the checkpoint.*\[0\.1\] in place of the \[0\.05\]"):
        tg.load(path, state, strict=False)
    for g, lr in zip(optim2.param_groups, sched.get_last_lr()):  # what the warning says to do
        g["lr"] = lr
    for _ in range(4):
        optim2.step()
        sched.step()
    assert optim2.param_groups[0]["lr"] == pytest.approx(0.1)  # without it: 0.2, twice the peak

    import warnings

    _, _, state = resumed(1.0)  # a scheduler that leaves the lr as it is: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.load(path, state, strict=False)
