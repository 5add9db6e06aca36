"""``trainguard doctor`` on real training scripts (review): excerpts of popular scripts, each with its source."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd
from trainguard.doctor import Finding

# Module-level training, as in https://github.com/karpathy/nanoGPT/blob/master/train.py (excerpt,
# shortened): no trainguard_state(), training runs at import. The marker stands for the training
# run (data loading, GPU work, out/ckpt.pt overwritten) that importing it would start.
NANOGPT = """\
import os
import torch
ddp = int(os.environ.get('RANK', -1)) != -1
master_process = True
open({marker!r}, 'w').write('training started')
while True:
    if master_process:
        checkpoint = {{'model': 1, 'iter_num': 0}}
        torch.save(checkpoint, os.path.join('out', 'ckpt.pt'))
    break
"""


def test_a_script_without_the_hook_is_not_run_only_its_source_checked(tmp_path: Path) -> None:
    marker = tmp_path / "trained"
    script = tmp_path / "train.py"
    script.write_text(NANOGPT.format(marker=str(marker)))
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert not marker.exists(), "doctor ran the script's module-level training"
    assert res.exit_code == 1 and "trainguard_state()" in res.output and "not imported" in res.output
    found = json.loads(res.stdout.splitlines()[0])  # the source checks still ran
    assert {f["check"]: f["severity"] for f in found}["all ranks save"] == "warning"
    assert "line 9" in next(f["message"] for f in found if f["check"] == "all ranks save")


def test_a_script_that_is_not_python3_is_a_clear_message(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text("import torch\nprint 'epoch', 1\n")  # a Python 2 training script
    res = CliRunner().invoke(doctor_cmd, [str(script)])
    assert res.exit_code == 2 and "line 2" in res.output and "Traceback" not in res.output  # held before too


# https://github.com/pytorch/examples/blob/main/mnist/main.py (excerpt): the loader's arguments are
# a dict built a few lines above; the same shape in distributed/FSDP/T5_training.py.
MNIST = """\
import torch
train_kwargs = {'batch_size': args.batch_size}
if use_accel:
    accel_kwargs = {'num_workers': 1, 'persistent_workers': True, 'pin_memory': True, 'shuffle': True}
    train_kwargs.update(accel_kwargs)
train_loader = torch.utils.data.DataLoader(dataset1, **train_kwargs)
"""


def _loader_finding(src: str) -> tuple[str, str]:
    from trainguard.doctor import Settings
    from trainguard.doctor_source import loader_generator

    f = loader_generator([], Settings(source=src))
    assert f is not None
    return f.severity, f.message


def test_loader_kwargs_built_in_the_script_are_read() -> None:
    severity, message = _loader_finding(MNIST)
    assert severity == "warning" and "line 6" in message  # was "ok: the DataLoader has its own generator"
    with_gen = MNIST.replace("'shuffle': True}", "'shuffle': True, 'generator': torch.Generator()}")
    assert _loader_finding(with_gen)[0] == "ok"
    assert _loader_finding(MNIST + "train_kwargs['generator'] = g\n")[0] == "ok"  # x["k"] = ... counts
    assert _loader_finding(MNIST.replace("train_kwargs.update(accel_kwargs)", "train_kwargs.update(extra)"))[0] \
        == "info"  # extra comes from nowhere in the text: not decided


def test_loader_kwargs_out_of_sight_are_not_called_the_loaders_own_generator() -> None:
    src = "def make(ds, **kw):\n    return torch.utils.data.DataLoader(ds, **kw)\n"
    severity, message = _loader_finding(src)
    assert severity == "info" and "**kw" in message and "has its own generator" not in message


# https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multigpu_torchrun.py
# (excerpt): rank 0 (the GPU id read from LOCAL_RANK) saves through a method of the trainer.
DDP_TUTORIAL = """\
import os
import torch
class Trainer:
    def __init__(self):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
"""


def _rank_finding(src: str) -> tuple[str, str]:
    from trainguard.doctor import Settings
    from trainguard.doctor_source import single_rank

    f = single_rank([], Settings(source=src))
    assert f is not None
    return f.severity, f.message


def test_a_rank0_save_through_a_helper_of_the_script_is_seen() -> None:
    severity, message = _rank_finding(DDP_TUTORIAL)
    assert severity == "warning" and "torch.save (in _save_snapshot)" in message and "line 12" in message
    # minGPT-ddp (same repository, mingpt/trainer.py): `if self.local_rank == 0 ...: self._save_snapshot(epoch)`
    mingpt = DDP_TUTORIAL.replace("self.gpu_id == 0", "self.local_rank == 0")
    assert _rank_finding(mingpt)[0] == "warning"
    ckpt = DDP_TUTORIAL.replace("torch.save(snapshot, self.snapshot_path)", "self.mgr.save(epoch, snapshot)")
    severity, message = _rank_finding(ckpt)  # a collective save reached from rank 0 only: an error
    assert severity == "error" and "_save_snapshot" in message


def test_helpers_that_save_no_checkpoint_and_other_ids_stay_quiet() -> None:
    plot = DDP_TUTORIAL.replace("torch.save(snapshot, self.snapshot_path)", "np.save(self.path, snapshot)")
    assert _rank_finding(plot)[0] == "ok"  # the helper saves a numpy array: no checkpoint
    every_rank = DDP_TUTORIAL.replace("self.gpu_id == 0 and ", "")
    assert _rank_finding(every_rank)[0] == "ok"
    not_a_rank = DDP_TUTORIAL.replace('int(os.environ["LOCAL_RANK"])', "0")  # gpu_id is no rank here
    assert _rank_finding(not_a_rank)[0] == "ok"


# examples/ddp_torchrun.py of this repository, before: the per-rank seed came after the restore, so
# a run resumed at step 9 drew other data than an uninterrupted one (weights at step 19 differed).
RESEED = """\
import torch
import trainguard as tg
def main():
    state = {"model": model, "optim": opt, "rng": tg.RNGState()}
    with tg.CheckpointManager(args.dir, save=tg.EveryNSteps(4)) as mgr:
        start = mgr.restore(state)
        torch.manual_seed(1000 + rank)  # each rank its own data
        for step in range(0 if start is None else start + 1, args.steps):
            x = torch.randn(16, 8)
"""


def _reseed(src: str) -> Finding | None:
    from trainguard.doctor import Settings
    from trainguard.doctor_source import reseed

    return reseed([], Settings(source=src))


def test_a_global_seed_after_the_restore_is_a_warning() -> None:
    f = _reseed(RESEED)
    assert f is not None and f.severity == "warning" and "line 7: torch.manual_seed(1000 + rank)" in f.message
    fresh_only = RESEED.replace("        torch.manual_seed(1000 + rank)", "        if start is None:\n"
                                "            torch.manual_seed(1000 + rank)")
    assert _reseed(fresh_only).severity == "ok"  # type: ignore[union-attr]
    before = RESEED.replace("        torch.manual_seed(1000 + rank)  # each rank its own data\n", "").replace(
        "    with tg", "    torch.manual_seed(1000 + rank)\n    with tg")
    assert _reseed(before).severity == "ok"  # type: ignore[union-attr]
    own_generator = RESEED.replace("torch.manual_seed(1000 + rank)", "g.manual_seed(1000 + rank)")
    assert _reseed(own_generator).severity == "ok"  # type: ignore[union-attr]
    assert _reseed("import torch\ntorch.manual_seed(0)\n") is None  # no restore: nothing to overwrite


def test_the_ddp_example_seeds_before_it_restores() -> None:
    src = (Path(__file__).parent.parent / "examples" / "ddp_torchrun.py").read_text()
    f = _reseed(src)
    assert f is not None and f.severity == "ok", f


# https://github.com/huggingface/pytorch-image-models/blob/main/train.py (excerpt): the checkpoint
# saver exists on the primary rank only, and its saves are guarded by `if saver is not None`.
TIMM = """\
saver = None
if utils.is_primary(args):
    output_dir = utils.get_outdir(args.output if args.output else './output/train', exp_name)
    saver = utils.CheckpointSaver(model=model, optimizer=optimizer, args=args, checkpoint_dir=output_dir)
for epoch in range(start_epoch, num_epochs):
    if saver is not None:
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=latest_metric)
"""


def test_a_saver_made_on_rank0_only_is_a_rank0_save() -> None:
    severity, message = _rank_finding(TIMM)
    assert severity == "warning" and "saver.save_checkpoint" in message and "line 7" in message
    everywhere = TIMM.replace("if utils.is_primary(args):", "if True:")
    assert _rank_finding(everywhere)[0] == "ok"
    wandb_run = "run = None\nif rank == 0:\n    run = wandb.init(project='x')\nrun.save('config.yaml')\n"
    assert _rank_finding(wandb_run)[0] == "ok"  # a wandb file upload, no checkpoint
