"""A run resumed after its configuration changed between runs (session 22 review, "resume").

Run 1 saves in a child process (the first run of a job); run 2 is this process with the changed
configuration, restoring from run 1's checkpoint with ``CheckpointManager.restore``. Each change
either resumes as documented (docs/checkpoints.md, "Changing the configuration between runs")
or is refused with an error that says what to change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg

ROOT = Path(__file__).resolve().parent.parent

RUN1 = """
import json, sys, torch, trainguard as tg
for name, extra in json.loads(sys.argv[2]).items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optimizer}
    exec(extra)
    with tg.CheckpointManager(f"{sys.argv[1]}/{name}", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            optimizer.step()
            if "sched" in state:
                state["sched"].step()
            mgr.save(step, state)
"""

RUNS = {  # run 1 of each test: what its state holds beside the model and the Adam optimizer
    "scaler_off": 'state["scaler"] = torch.amp.GradScaler("cpu", enabled=False)',
    "scaler_on": 'state["scaler"] = torch.amp.GradScaler("cpu", init_scale=512.0)',
    "plain": "",
    "cosine": 'state["sched"] = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)',
    "data": 'state["data"] = tg.ResumableSampler(32, seed=0); state["data"].advance(16)',
}


@pytest.fixture(scope="module")
def run1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 1 of every test, in one child process (a process start costs seconds on a loaded machine):
    three steps each, a checkpoint at each, under ``<root>/<name>``."""
    root = tmp_path_factory.mktemp("run1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-c", RUN1, str(root), json.dumps(RUNS)], env=env, check=True, timeout=300)
    return root


def _model_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)  # other values than run 1's: a load that does not happen shows
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _restore(root: Path, state: dict, strict: bool = True) -> tuple[int | None, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1000), handle_signals=False) as mgr:
            step = mgr.restore(state, strict=strict)
    return step, [str(w.message) for w in got]


def test_grad_scaler_enabled_since_a_save_with_it_disabled(run1: Path) -> None:
    """Seen before: refused with strict=False too, "The source state dict is empty ... The object
    must be built the same way as when it was saved": no way to turn mixed precision on."""
    root = run1 / "scaler_off"
    model, optim = _model_optim()
    state = {"model": model, "optim": optim, "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0)}
    with pytest.raises(tg.CheckpointError) as e:
        _restore(root, state)
    assert "GradScaler was disabled" in str(e.value) and "strict=False" in str(e.value), str(e.value)
    assert tg.exit_code_for(e.value) == 78  # the same at every restart

    model, optim = _model_optim()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step, warned = _restore(root, {"model": model, "optim": optim, "scaler": scaler}, strict=False)
    assert step == 2 and scaler.get_scale() == 1024.0  # fresh, as built
    assert optim.state and any("starts fresh" in w for w in warned), warned
    ref = {"model": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))}
    tg.load(root / "step-000000002", ref, only=["model"])
    assert torch.equal(ref["model"][0].weight, model[0].weight)


def test_grad_scaler_disabled_since_a_save_with_it_enabled(run1: Path) -> None:
    """The reverse change is torch's: a disabled scaler ignores the saved scale (nothing to refuse)."""
    root = run1 / "scaler_on"
    model, optim = _model_optim()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step, _ = _restore(root, {"model": model, "optim": optim, "scaler": scaler})
    assert step == 2 and not scaler.is_enabled() and scaler.state_dict() == {}


def test_model_built_in_another_dtype_says_what_strict_false_does(run1: Path) -> None:
    """fp32 saved, bf16 built: the error said "Pass strict=False to load what matches", which
    reads as if the bf16 tensors were left out; strict=False casts them (model and moments)."""
    model, optim = _model_optim()
    model.to(torch.bfloat16)
    with pytest.raises(tg.StateMismatchError) as e:
        _restore(run1 / "plain", {"model": model, "optim": optim})
    assert "4 of the tensors differ in dtype only" in str(e.value), str(e.value)
    assert "casts them into the state's dtype" in str(e.value)

    step, _ = _restore(run1 / "plain", {"model": model, "optim": optim}, strict=False)
    ref, _ = _model_optim()
    tg.load(run1 / "plain" / "step-000000002", {"model": ref}, only=["model"])
    assert step == 2 and model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, ref[0].weight.to(torch.bfloat16))  # cast, not left as built
    assert optim.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16


def test_scheduler_added_since_the_save(run1: Path) -> None:
    """A scheduler added in run 2: refused, saying that strict=False keeps it fresh; it then
    starts from last_epoch 0 while the optimizer's lr is the checkpoint's."""
    model, optim = _model_optim()
    optim.param_groups[0]["lr"] = 0.05  # run 2's config: another lr, overridden by the checkpoint's
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    state = {"model": model, "optim": optim, "sched": sched}
    with pytest.raises(tg.StateMismatchError) as e:
        _restore(run1 / "plain", state)
    assert "Entries the checkpoint lacks (sched: added since the save?) keep their fresh state" in str(e.value), str(e.value)
    step, _ = _restore(run1 / "plain", state, strict=False)
    assert step == 2 and sched.last_epoch == 0 and sched.base_lrs == [0.05]
    assert optim.param_groups[0]["lr"] == 0.1  # the checkpoint's group values win (documented)


def test_dataset_grew_since_the_save_says_how_to_go_on(run1: Path) -> None:
    """A dataset of 32 samples saved at sample 16 of epoch 0, 40 samples now: refused (as before),
    and the message now names the saved epoch and the way to go on, which works as written."""
    model, optim = _model_optim()
    state = {"model": model, "optim": optim, "data": tg.ResumableSampler(40, seed=0)}
    with pytest.raises(tg.CheckpointError) as e:
        _restore(run1 / "data", state)
    msg = str(e.value)
    assert "saved at epoch 0, sample 16" in msg and "sampler.set_epoch(1)" in msg and "strict=False" in msg, msg
    assert tg.exit_code_for(e.value) == 78

    data = state.pop("data")  # what the message says
    step, _ = _restore(run1 / "data", state, strict=False)
    state["data"] = data
    data.set_epoch(1)
    assert step == 2 and optim.state and sorted(data) == list(range(40))  # the new dataset's whole epoch


def test_layer_frozen_since_the_save_with_an_optimizer_of_trainable_parameters(run1: Path) -> None:
    """Layer 0 frozen in run 2 and the optimizer built from the trainable parameters only: refused
    as before, now naming what the optimizer lacks and why; the advice (all parameters) resumes
    with the frozen layer left as loaded."""
    model, _ = _model_optim()
    for p in model[0].parameters():
        p.requires_grad_(False)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(tg.CheckpointError) as e:
        _restore(run1 / "plain", {"model": model, "optim": optim})
    msg = str(e.value)
    assert "holds ['0.weight', '0.bias'], which the optimizer's lacks" in msg and "frozen since the save" in msg, msg

    optim = torch.optim.Adam(model.parameters(), lr=0.1)  # what the message says
    step, warned = _restore(run1 / "plain", {"model": model, "optim": optim})
    assert step == 2 and any("trainable then and are frozen now" in w for w in warned), warned
    frozen, head = model[0].weight.clone(), model[2].weight.clone()
    optim.zero_grad()
    model(torch.randn(5, 4)).square().mean().backward()
    optim.step()
    assert torch.equal(model[0].weight, frozen) and not torch.equal(model[2].weight, head)


def test_scheduler_configuration_changed_since_the_save_is_warned(run1: Path) -> None:
    """Training extended: CosineAnnealingLR(T_max=10) saved, T_max=40 built. The checkpoint's T_max
    wins (torch's load_state_dict takes every attribute): before, silently, and the lr went back up
    to the full lr by step 20. Now warned, naming both values; setting it after the restore works."""
    def build(t_max: int) -> tuple[dict, torch.optim.lr_scheduler.CosineAnnealingLR]:
        model, optim = _model_optim()
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=t_max)
        return {"model": model, "optim": optim, "sched": sched}, sched

    state, sched = build(10)  # the same configuration: no word
    step, warned = _restore(run1 / "cosine", state)
    assert step == 2 and not [w for w in warned if "scheduler has" in w], warned

    state, sched = build(40)
    step, warned = _restore(run1 / "cosine", state)
    assert step == 2 and sched.T_max == 10 and sched.last_epoch == 3  # the checkpoint's, as torch's load gives
    hits = [w for w in warned if "the checkpoint's scheduler has T_max=10, this run built it with T_max=40" in w]
    assert len(hits) == 1 and "sched.T_max = 40" in hits[0], warned
    sched.T_max = 40  # what the warning says
    for _ in range(3, 20):
        state["optim"].step()
        sched.step()
    assert sched.get_last_lr()[0] < 0.1 * 0.9  # still annealing at step 20 (with T_max=10: back at 0.1)
