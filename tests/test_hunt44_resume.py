"""Resume under real crashes (hunt44, resume), and what it found.

A loop that draws from a generator object of its own (``torch.randn(..., generator=g)``,
``rng.integers(...)``) that ``tg.RNGState(generators=...)`` does not name resumes with that generator
rebuilt from its seed: seen with a real SIGKILL at step 6 of a run saved every 4 steps, the resumed
run's losses differed from step 5 on, with no warning anywhere. ``trainguard doctor`` said nothing
about it; it now reports the "own generators" check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainguard.doctor import Finding, Settings
from trainguard.doctor_source import check_source

from conftest import run_py

LOOP = """
import numpy as np
import torch
import trainguard as tg

noise = torch.Generator().manual_seed(11)
rng = np.random.default_rng(0)
state = {"model": model, "optim": opt, "rng": tg.RNGState(%s)}
with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(4)) as mgr:
    start = mgr.restore(state)
    for step in range(0 if start is None else start + 1, 100):
        x = torch.randn(4, 8, generator=noise)
        keep = rng.random() < 0.5
        model(x).sum().backward()
        opt.step()
        mgr.save(step, state)
"""


def _own(src: str) -> list[Finding]:
    return [f for f in check_source(Settings(source=src)) if f.check == "own generators"]


def test_doctor_reports_a_generator_drawn_in_the_loop_and_not_saved() -> None:
    (f,) = _own(LOOP % "")
    assert f.severity == "warning" and "`noise` (line 6)" in f.message and "(and rng)" in f.message, f
    assert "generators={'noise': noise}" in f.fix
    (f,) = _own(LOOP % 'generators={"noise": noise, "np": rng}')
    assert f.severity == "ok", f
    (f,) = _own(LOOP % 'generators={"noise": noise}')  # rng still not saved
    assert f.severity == "warning" and "`rng`" in f.message, f


def test_doctor_reports_a_modules_own_generator_and_a_helpers_draws() -> None:
    layer = """
import torch
class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)
    def forward(self, x):
        return x + torch.randn(x.shape, generator=self.gen)
"""
    (f,) = _own(layer)
    assert f.severity == "warning" and "`gen`" in f.message, f
    helper = """
import random
r = random.Random(3)
def get_batch():
    return r.randrange(100)
for step in range(10):
    get_batch()
    opt.step()
"""
    (f,) = _own(helper)
    assert f.severity == "warning" and "random.Random() `r`" in f.message, f


@pytest.mark.parametrize("src", [
    # re-seeded at every pass: the same numbers in both runs
    "import torch\ng = torch.Generator()\nfor s in range(9):\n    g.manual_seed(s)\n    torch.randn(2, generator=g)\n    opt.step()\n",
    # made in the loop
    "import torch\nfor s in range(9):\n    g = torch.Generator().manual_seed(s)\n    torch.randn(2, generator=g)\n    opt.step()\n",
    # the loader's generator: the "data randomness" check's business
    "import torch\ng = torch.Generator()\nfor s in range(9):\n    dl = DataLoader(ds, generator=g)\n    opt.step()\n",
    # drawn from once, before the training
    "import torch\ng = torch.Generator().manual_seed(0)\nw = torch.randn(8, generator=g)\nfor s in range(9):\n    opt.step()\n",
])
def test_doctor_leaves_generators_that_resume_alone(src: str) -> None:
    assert _own(src) == []


def test_doctor_cli_on_a_real_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LOOP % "")
    r = run_py(["-m", "trainguard", "doctor", str(script), "--json"])
    found = [f for f in json.loads(r.stdout) if f["check"] == "own generators"]
    assert [f["severity"] for f in found] == ["warning"], r.stdout + r.stderr



EMA_LOOP = """
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
import trainguard as tg

ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
state = {"model": model, "optim": opt, "rng": tg.RNGState()%s}
with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(4)) as mgr:
    start = mgr.restore(state)
    for step in range(0 if start is None else start + 1, 100):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        ema.update_parameters(model)
        mgr.save(step, state)
"""


def _ema(src: str, state: dict | None = None) -> list[Finding]:
    from trainguard.doctor import check

    return [f for f in check(state or {}, Settings(source=src)) if f.check == "ema"]


def test_doctor_reports_an_ema_updated_in_the_loop_and_not_saved() -> None:
    # Seen: an AveragedModel left out of the state, resumed after a SIGKILL at step 6 (saved at 4):
    # every tensor equal to the uninterrupted run's but the EMA's.
    (f,) = _ema(EMA_LOOP % "")
    assert f.severity == "warning" and "AveragedModel `ema` (line 6)" in f.message, f
    assert f.fix == 'add state["ema"] = ema'
    (f,) = _ema(EMA_LOOP % ', "ema": ema')
    assert f.severity == "ok", f
    timm = """
from timm.utils import ModelEmaV2
model_ema = ModelEmaV2(model, decay=0.9998)
def train_one_epoch():
    for x in loader:
        loss(x).backward()
        opt.step()
        model_ema.update(model)
for epoch in range(10):
    train_one_epoch()
    mgr.save(epoch, {"model": model, "optim": opt})
"""
    (f,) = _ema(timm)
    assert f.severity == "warning" and "ModelEmaV2 `model_ema`" in f.message, f


def test_doctor_ema_check_reads_the_hooks_state() -> None:
    from torch.optim.swa_utils import AveragedModel

    model = torch.nn.Linear(2, 2)
    src = EMA_LOOP % ', "ema": ema'  # the source names it; the state the hook returned does not hold it
    (f,) = _ema(src, {"model": model})
    assert f.severity == "warning", f
    (f,) = _ema(EMA_LOOP % "", {"model": model, "ema": AveragedModel(model)})
    assert f.severity == "ok", f
    assert _ema("from torch.optim.swa_utils import AveragedModel\nema = AveragedModel(model)\n") == []  # never updated
