"""Second review of session 44's changes (helper review44b): defects found in what landed on main,
each checked against a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_py

EMA_SAVED_AS = """
import torch
import trainguard as tg
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
for step in range(10):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    ema.update_parameters(model)
    %s
"""


@pytest.mark.parametrize("save", [
    # the EMA's state_dict in the dict saved (the usual torch.save-style dict)
    'tg.save(f"ckpt/step-{step}", {"model": model.state_dict(), "opt": opt.state_dict(), "ema": ema.state_dict()})',
    # timm's pattern: the averaged module itself (ModelEmaV2.module, AveragedModel.module)
    'state = {"model": model, "optimizer": opt}\n    state["ema"] = ema.module\n    tg.save(f"ckpt/step-{step}", state)',
])
def test_doctor_ema_saved_through_what_it_holds_is_ok(tmp_path: Path, save: str) -> None:
    """Before: 'AveragedModel `ema` ... is updated at each step but is not in the state' for an EMA
    whose state_dict() or .module is in the saved dict (a false warning on ordinary scripts)."""
    script = tmp_path / "train.py"
    script.write_text(EMA_SAVED_AS % save)
    r = run_py(["-m", "trainguard", "doctor", str(script), "--json"])
    found = [f for f in json.loads(r.stdout) if f["check"] == "ema"]
    assert [f["severity"] for f in found] == ["ok"], r.stdout + r.stderr


def test_doctor_ema_of_another_object_in_the_dict_is_still_reported(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(EMA_SAVED_AS % 'tg.save(f"ckpt/step-{step}", {"model": model.state_dict(), "opt": opt.state_dict()})')
    r = run_py(["-m", "trainguard", "doctor", str(script), "--json"])
    found = [f for f in json.loads(r.stdout) if f["check"] == "ema"]
    assert [f["severity"] for f in found] == ["warning"], r.stdout + r.stderr
