"""Doctor review 21: a save between the micro-batches of one optimizer step (gradient accumulation)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from trainguard.doctor import Settings, check

ACCUM = """
import torch
def main(model, opt, sched, loader, mgr, state, accum=4):
    step = mgr.restore(state) or 0
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        step += 1
        mgr.save(step, state)
        if (i + 1) % accum == 0:
            opt.step()
            sched.step()
            opt.zero_grad()
"""

NANOGPT_INNER = """
def train(model, optimizer, scaler, get_batch, mgr, state, gradient_accumulation_steps):
    for it in range(1000):
        for micro_step in range(gradient_accumulation_steps):
            loss = model(*get_batch())
            scaler.scale(loss).backward()
            mgr.save(it, state)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
"""


def found(src: str) -> list:
    return [f for f in check({}, Settings(source=textwrap.dedent(src))) if f.check == "save mid-accumulation"]


def test_a_save_on_every_micro_batch_of_an_accumulating_loop_is_a_warning() -> None:
    (f,) = found(ACCUM)
    assert f.severity == "warning" and "line 9: mgr.save(step, state)" in f.message, f
    assert "(i + 1) % accum == 0" in f.message and "line 10" in f.message and "optimizer.step()" in f.fix
    # counted in optimizer steps but saved before the step's `if`: one micro-batch of the next step is in .grad
    before = ACCUM.replace("        step += 1\n", "").replace("            opt.zero_grad()\n",
                                                             "            opt.zero_grad()\n            step += 1\n")
    (f,) = found(before)
    assert f.severity == "warning" and "line 8: mgr.save(step, state)" in f.message, f
    (f,) = found(NANOGPT_INNER)
    assert f.severity == "warning" and "line 7: mgr.save(it, state)" in f.message
    assert "(line 4)" in f.message and "(line 8)" in f.message, f


def test_saves_after_the_optimizer_step_are_not_reported() -> None:
    inside = ACCUM.replace("        mgr.save(step, state)\n", "").replace(
        "            opt.zero_grad()\n", "            opt.zero_grad()\n            mgr.save(step, state)\n")
    gated = ACCUM.replace("        mgr.save(step, state)\n", "        if (i + 1) % accum == 0:\n"
                          "            mgr.save(step, state)\n")
    # the step and the save both run after the continue (the save stayed before it until session 57: a save on
    # every micro-batch, which this asserted "ok"; tests/test_hunt57_review57f.py reports that one)
    skipped = ACCUM.replace("        mgr.save(step, state)\n", "").replace(
        "        if (i + 1) % accum == 0:\n", "        if (i + 1) % accum:\n            continue\n        if True:\n").replace(
        "            opt.zero_grad()\n", "            opt.zero_grad()\n        mgr.save(step, state)\n")
    # a step under a test that is no accumulation (a GradScaler or not), or every micro-batch's (DeepSpeed)
    either = """
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        if scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
        mgr.save(step, state)
    """
    engine = "for b in loader:\n    engine.backward(engine(b))\n    engine.step()\n    mgr.save(step, state)\n"
    nanogpt = NANOGPT_INNER.replace("            mgr.save(it, state)\n", "").replace(
        "        optimizer.zero_grad(set_to_none=True)\n",
        "        optimizer.zero_grad(set_to_none=True)\n        mgr.save(it, state)\n")
    # the step counted in optimizer steps, saved after the step's `if` on every micro-batch: saved once per step
    counted = ACCUM.replace("        mgr.save(step, state)\n", "").replace("        step += 1\n", "").replace(
        "            opt.zero_grad()\n", "            opt.zero_grad()\n            step += 1\n        mgr.save(step, state)\n")
    for src in (inside, gated, skipped, either, engine, nanogpt, counted):
        (f,) = found(src)
        assert f.severity == "ok", (src, f)
    assert found("mgr.save(1, state)\n") == []  # no training loop: nothing to judge


def test_the_doctor_command_reports_it_for_a_script_without_the_hook(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ACCUM))
    r = subprocess.run([sys.executable, "-c", "import sys; from trainguard.cli import main; "
                        "sys.argv = ['trainguard', 'doctor', sys.argv[1]]; sys.exit(main())", str(script)],
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": "src", "COLUMNS": "300",
                                                                        "PATH": "/usr/bin:/bin"})
    assert "save mid-accumulation" in r.stdout and "warning" in r.stdout, r.stdout + r.stderr


def _accumulate(root: Path, counted: bool, async_save: bool) -> tuple[list[int], int]:
    """16 micro-batches in windows of 4, mgr.save on every micro-batch; ``counted``: the step counts
    optimizer steps (the doctor's ok case), else micro-batches (its warning)."""
    import warnings

    import torch

    import trainguard as tg

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    saved: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(str(root), save=tg.EveryNSteps(2), keep=tg.KeepLatest(8),
                                  async_save=async_save) as mgr:
            step = mgr.restore(state) or 0
            for i in range(16):
                model(torch.randn(4, 8)).sum().backward()
                step += 0 if counted else 1
                if (i + 1) % 4 == 0:
                    opt.step()
                    opt.zero_grad()
                    step += 1 if counted else 0
                if mgr.save(step, state) is not None:
                    saved.append(step)
    return saved, sum(issubclass(w.category, tg.PendingGradientsWarning) for w in caught)


def test_a_step_counted_in_optimizer_steps_and_saved_every_micro_batch_is_not_warned(tmp_path: Path) -> None:
    # The manager saves step 2 once, right after the optimizer step; the calls of the next window with
    # step 2 save nothing, and used to warn of the window's gradients all the same (3 per saved step).
    for async_save in (False, True):
        saved, warned = _accumulate(tmp_path / f"counted{async_save}", counted=True, async_save=async_save)
        assert saved == [2, 4] and warned == 0, (async_save, saved, warned)
    saved, warned = _accumulate(tmp_path / "micro", counted=False, async_save=False)
    assert saved == [2, 4, 6, 8, 10, 12, 14, 16] and warned == 4  # the saves at micro-batches 2, 6, 10, 14: still warned


AUG = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Aug(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 8)  # built in the main process, before the restore: no worker draw

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.9, 1.1))


loader = DataLoader(Aug(64), batch_size=4, num_workers=2, generator=torch.Generator())
"""


def worker(src: str) -> list:
    return [f for f in check({}, Settings(source=textwrap.dedent(src))) if f.check == "worker randomness"]


def test_a_global_draw_in_a_datasets_getitem_read_by_workers_is_a_warning() -> None:
    # Seen (bench): random.random() in __getitem__, 2 workers, the loader's own generator, a
    # ResumableSampler restored at sample 8 of 16: sample 8 drew 0.808 resumed, 0.156 uninterrupted.
    (f,) = worker(AUG)
    assert f.severity == "warning" and "line 17: random.random() in Aug.__getitem__" in f.message, f
    assert "SeededDataset" in f.fix
    (f,) = worker(AUG.replace("DataLoader(Aug(64),", "DataLoader(tg.SeededDataset(Aug(64), seed=0),"))
    assert f.severity == "ok", f


def test_draws_a_resume_repeats_are_not_reported() -> None:
    assert worker(AUG.replace("num_workers=2", "num_workers=0")) == []  # the main process: tg.RNGState holds them
    own = (AUG.replace("random.random()", "random.Random(i).random()")
              .replace("np.random.uniform(0.9, 1.1)", "np.random.default_rng(i).uniform(0.9, 1.1)"))
    assert worker(own) == []  # a generator of the sample's own
    torch_own = AUG.replace("random.random() < 0.5", "torch.rand(1, generator=torch.Generator().manual_seed(i)) < 0.5")
    torch_own = torch_own.replace("float(np.random.uniform(0.9, 1.1))", "1.0")
    assert worker(torch_own) == []
    assert worker(torch_own.replace(", generator=torch.Generator().manual_seed(i))", ")"))[0].severity == "warning"
