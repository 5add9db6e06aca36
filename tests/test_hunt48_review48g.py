"""``trainguard doctor`` on realistic training scripts (session 48, review48g).

A validation loader without ``generator=`` whose passes neither save nor train: each pass starts
its iterator at the same point of the global torch stream in the uninterrupted and the resumed run,
and ``tg.RNGState`` saves that stream, so a resume stays bit-identical (measured: a dropout model,
``DataLoader(val_ds, batch_size=16, shuffle=False)``, stopped after step 45 with saves every 10,
resumed: same final weights and best validation loss as the run that never stopped). The "data
randomness" check warned about it; a correct script with early stopping got a warning."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd

SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

train_ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
val_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))


def trainguard_state():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    sampler = tg.ResumableSampler(len(train_ds), seed=0)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "data": sampler,
             "rng": tg.RNGState(), "progress": tg.StateDict(step=-1, best=1e9)}
    return state, {"root": ROOT, "save": tg.EveryNSteps(10), "keep": tg.KeepLatest(2)}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total = 0.0
    for x, y in loader:
        total += nn.functional.mse_loss(model(x), y).item()
    model.train()
    return total / len(loader)


def main():
    state, settings = trainguard_state()
    model, optimizer, scheduler, sampler = state["model"], state["optim"], state["sched"], state["data"]
    train_loader = DataLoader(train_ds, batch_size=8, sampler=sampler, TRAIN_GEN)
    val_loader = DataLoader(val_ds, batch_size=8, shuffle=False)
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        step = -1 if start is None else start
        while sampler.epoch < 3:
            for x, y in train_loader:
                step += 1
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                sampler.advance(len(x))
                state["progress"]["step"] = step
                mgr.save(step, state)
            VAL_PASS
            sampler.next_epoch()


if __name__ == "__main__":
    main()
'''
EVALUATE = 'state["progress"]["best"] = min(state["progress"]["best"], evaluate(model, val_loader))'
INLINE_SAVE = 'for vx, vy in val_loader:\n                mgr.save(step, state, force=True)'


TRAIN_LINE = SCRIPT.splitlines().index(next(ln for ln in SCRIPT.splitlines() if "train_loader = " in ln)) + 1
VAL_LINE = TRAIN_LINE + 1


def _randomness(tmp_path: Path, train_gen: str = "generator=torch.Generator()", val_pass: str = EVALUATE) -> dict[str, str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("ROOT", repr(str(tmp_path / "ckpts"))).replace("TRAIN_GEN", train_gen)
                      .replace("VAL_PASS", val_pass))
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert res.exit_code == 0, res.output
    found = [f for f in json.loads(res.output) if f["check"] == "data randomness"]
    assert len(found) == 1, found
    return found[0]


def test_validation_loader_without_generator_is_not_reported(tmp_path: Path) -> None:
    f = _randomness(tmp_path)
    assert f["severity"] == "ok", f


def test_training_loader_without_generator_still_reported(tmp_path: Path) -> None:
    f = _randomness(tmp_path, train_gen="drop_last=False")
    assert f["severity"] == "warning", f
    assert f"(line {TRAIN_LINE})" in f["message"], f  # the training loader only


def test_loader_iterated_across_a_save_still_reported(tmp_path: Path) -> None:
    f = _randomness(tmp_path, val_pass=INLINE_SAVE)
    assert f["severity"] == "warning", f
    assert f"(line {VAL_LINE})" in f["message"], f


GAN = '''
import torch
from torch import nn

import trainguard as tg


def trainguard_state():
    netG = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
    netD = nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    ema = torch.optim.swa_utils.AveragedModel(netG)
    return {"netG": netG, "netD": netD, "ema": ema, SAVED, "rng": tg.RNGState()}, {"root": ROOT}
'''


def _optim(tmp_path: Path, saved: str) -> tuple[int, dict[str, str]]:
    script = tmp_path / "gan.py"
    script.write_text(GAN.replace("ROOT", repr(str(tmp_path / "ckpts"))).replace("SAVED", saved))
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, next(f for f in json.loads(res.output) if f["check"] == "optimizer+scheduler")


def test_gan_with_one_of_two_optimizers_saved_is_an_error(tmp_path: Path) -> None:
    rc, f = _optim(tmp_path, '"optG": optG')
    assert rc == 1 and f["severity"] == "error", f
    assert "netD" in f["message"] and "optD" in f["message"], f


def test_gan_with_both_optimizers_saved_is_not_an_error(tmp_path: Path) -> None:
    rc, f = _optim(tmp_path, '"optG": optG, "optD": optD')
    assert f["severity"] == "warning" and "without an LR scheduler" in f["message"], f  # constant lr: as before


def test_persistent_worker_validation_loader_still_reported(tmp_path: Path) -> None:
    persistent = SCRIPT.replace("shuffle=False)", "shuffle=False, num_workers=2, persistent_workers=True)")
    script = tmp_path / "train.py"
    script.write_text(persistent.replace("ROOT", repr(str(tmp_path / "ckpts"))).replace(
        "TRAIN_GEN", "generator=torch.Generator()").replace("VAL_PASS", EVALUATE))
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    f = next(f for f in json.loads(res.output) if f["check"] == "data randomness")
    assert f["severity"] == "warning" and f"(line {VAL_LINE})" in f["message"], f
