"""Session 57, review57f: a hostile review of ``trainguard doctor`` and ``trainguard plan`` with
training scripts written the way users write them, odd inputs, and the Young/Daly figures
computed here independently of :mod:`trainguard.reliability`."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd, plan_cmd


def _doctor(script, *args):
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json", *args])
    return res


DATACLASS_SCRIPT = '''
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import trainguard as tg


@dataclass
class Config:
    lr: float = 3e-4
    tags: list[str] = field(default_factory=list)


def trainguard_state():
    cfg = Config()
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    return {"model": model, "optim": opt, "rng": tg.RNGState()}


if __name__ == "__main__":
    raise SystemExit("training runs here")
'''


def test_a_script_with_a_dataclass_config_is_imported(tmp_path):
    # A config @dataclass under `from __future__ import annotations` (HF-style scripts): dataclasses looks
    # its module up in sys.modules, where the doctor had not put it: exit 2, "AttributeError: 'NoneType'
    # object has no attribute '__dict__'", and no finding at all.
    script = tmp_path / "train_cfg.py"
    script.write_text(DATACLASS_SCRIPT)
    res = _doctor(script)
    assert "NoneType" not in res.output, res.output
    checks = {f["check"]: f["severity"] for f in json.loads(res.output[res.output.index("["):])}
    assert checks["model"] == "ok" and checks["rng"] == "ok", checks


ACCUM_LOOP = '''
import torch
from torch import nn

ACCUM = 4
model = nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters())


def train(mgr, state, loader):
    step = 0
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y) / ACCUM
        loss.backward()
{early}        if (i + 1) % ACCUM != 0:
            continue
        optimizer.step()
        optimizer.zero_grad()
{late}        step += 1
'''


def _accum_finding(early: str, late: str):
    from trainguard.doctor import Settings
    from trainguard.doctor_accum import mid_accumulation

    return mid_accumulation([], Settings(source=ACCUM_LOOP.format(early=early, late=late)))


def test_a_save_before_the_accumulation_guard_clause_is_reported():
    # `if (i + 1) % accum != 0: continue` then the optimizer step: a save before the guard runs on every
    # micro-batch. It was "ok" (the step is in the loop, not under an `if`, so the loop was taken as stepping).
    f = _accum_finding("        mgr.save(step, state)\n", "")
    assert f is not None and f.severity == "warning", f
    assert "line 15" in f.message and "continue" in f.message, f.message


def test_a_save_after_the_accumulation_guard_clause_is_fine():
    f = _accum_finding("", "        mgr.save(step, state)\n")
    assert f is not None and f.severity == "ok", f
