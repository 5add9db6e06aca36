"""``trainguard doctor`` on real training scripts, second pass (review): excerpts of popular
scripts as fixtures, each with where it came from."""

from __future__ import annotations

from trainguard.doctor import Finding, Settings
from trainguard.doctor_rng import reseed
from trainguard.doctor_source import single_rank


def _rank(src: str) -> Finding:
    f = single_rank([], Settings(source=src))
    assert f is not None
    return f


# https://github.com/pytorch/examples/blob/main/imagenet/main.py (excerpt): with one process per
# GPU, the first rank of each node (args.rank % ngpus_per_node == 0) saves; on one node, rank 0 alone.
IMAGENET = """\
import torch
def main_worker(gpu, ngpus_per_node, args):
    for epoch in range(args.start_epoch, args.epochs):
        if not args.multiprocessing_distributed or (args.multiprocessing_distributed
                and args.rank % ngpus_per_node == 0):
            save_checkpoint({
                'epoch': epoch + 1,
                'state_dict': model.state_dict(),
                'optimizer' : optimizer.state_dict(),
            }, is_best)
def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
"""


def test_the_first_rank_of_each_node_saving_is_a_rank0_save() -> None:
    f = _rank(IMAGENET)
    assert f.severity == "warning" and "line 6" in f.message and "torch.save" in f.message, f  # was "ok"
    collective = IMAGENET.replace("torch.save(state, filename)", "mgr.save(state['epoch'], state)")
    assert _rank(collective).severity == "error"
    assert _rank(IMAGENET.replace("ngpus_per_node == 0", "2 == 0")).severity == "ok"  # every other rank: no rank 0 test


def _reseed(src: str) -> Finding:
    f = reseed([], Settings(source=src))
    assert f is not None
    return f


# The shape of many training scripts (HF's run_*_no_trainer.py call accelerate's set_seed; here the
# script's own helper, as in OLMo-style utilities): a seeding function defined above and called
# after the restore overwrites the RNG state just restored.
SEED_HELPER = """\
import random, numpy as np, torch
import trainguard as tg
def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
class Run:
    def _seed(self):
        seed_all(self.seed)
    def go(self, mgr, state):
        start = mgr.restore(state)
        self._seed()
def main():
    state = {"model": model, "rng": tg.RNGState()}
    mgr = tg.CheckpointManager("ckpt")
    start = mgr.restore(state)
    seed_all(args.seed)
"""


def test_a_seed_set_in_a_helper_called_after_the_restore_is_seen() -> None:
    f = _reseed(SEED_HELPER)
    assert f.severity == "warning" and "line 12: self._seed()" in f.message, f  # was "ok"
    main_only = SEED_HELPER.replace("        self._seed()\n", "")
    f = _reseed(main_only)
    assert f.severity == "warning" and "line 16: seed_all(args.seed)" in f.message, f
    fresh = main_only.replace("    seed_all(args.seed)", "    if start is None:\n        seed_all(args.seed)")
    assert _reseed(fresh).severity == "ok"
    before = main_only.replace("    seed_all(args.seed)\n", "").replace("    state = {", "    seed_all(args.seed)\n    state = {")
    assert _reseed(before).severity == "ok"
    quiet = main_only.replace("torch.manual_seed(seed)", "g.manual_seed(seed)").replace(
        "np.random.seed(seed)", "pass").replace("random.seed(seed)", "pass")
    assert _reseed(quiet).severity == "ok"  # the helper seeds its own generator only


# The restore inside a helper of the script, the seed after the call to it in main().
RESTORE_HELPER = """\
import torch
import trainguard as tg
def load_checkpoint(mgr, state):
    return mgr.restore(state)
def main():
    state = {"model": model, "rng": tg.RNGState()}
    mgr = tg.CheckpointManager("ckpt")
    start = load_checkpoint(mgr, state)
    torch.manual_seed(args.seed)
"""


def test_a_seed_after_a_helper_that_restores_is_seen() -> None:
    f = _reseed(RESTORE_HELPER)
    assert f.severity == "warning" and "line 9: torch.manual_seed(args.seed)" in f.message, f  # was "ok"
    fresh = RESTORE_HELPER.replace("    torch.manual_seed(args.seed)", "    if start is None:\n"
                                   "        torch.manual_seed(args.seed)")
    assert _reseed(fresh).severity == "ok"
    # examples/fsdp2.py: after training it rebuilds the state (which seeds) and restores into it to
    # compare: the seed is put back before anything draws (a false alarm with the helpers followed)
    rebuilt = RESTORE_HELPER + "    state2 = dict(state)\n    mgr.restore(state2)\n"
    assert _reseed(rebuilt).severity == "ok"
    trained = RESTORE_HELPER + "    for step in range(10):\n        x = torch.randn(3)\n    mgr.restore(state)\n"
    assert _reseed(trained).severity == "warning"  # the loop draws between the seed and the next restore


# https://github.com/facebookresearch/metaseq/blob/main/metaseq/cli/train.py (excerpt): rank 0
# runs one step under the profiler, every other step and rank the same train(), which saves.
METASEQ = """\
def train(samples):
    return validate_and_save(samples)
def validate_and_save(samples):
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr)
def loop(progress):
    for i, samples in enumerate(progress):
        if (
            distributed_utils.get_global_rank() == 0
            and cfg.common.profile
            and i == 5
        ):
            with profiler.profile(profile_memory=True) as prof:
                valid_losses, should_stop = train(samples)
            prof.export_chrome_trace("profiler_trace.json")
        else:
            valid_losses, should_stop = train(samples)
"""


def test_a_save_that_both_branches_of_a_rank0_test_make_is_every_ranks() -> None:
    f = _rank(METASEQ)
    assert f.severity == "ok", f  # was an error: "save called (in train) under a rank-0 condition (line 13)"
    profile_only = METASEQ.replace("else:\n            valid_losses, should_stop = train(samples)", "else:\n            pass")
    f = _rank(profile_only)
    assert f.severity == "error" and "line 13" in f.message, f  # the else no longer saves: rank 0 alone does


# https://github.com/allenai/OLMo/blob/main/scripts/train.py (excerpt): rank 0 writes the run's
# config; the checkpoints are saved by the trainer on every rank.
OLMO = """\
def main(cfg):
    if get_global_rank() == 0:
        if not cfg.dry_run:
            save_path = Path(cfg.save_folder) / "config.yaml"
            save_path.parent.mkdir(exist_ok=True, parents=True)
            cfg.save(save_path)
    barrier()
    with Trainer(cfg=cfg, model=olmo_model) as trainer:
        trainer.save_checkpoint(checkpoint_type=checkpoint_type)
"""


def test_a_config_written_on_rank0_is_no_checkpoint() -> None:
    f = _rank(OLMO)
    assert f.severity == "ok", f  # was an error: "save called under a rank-0 condition (line 6)"
    for who in ("self.config", "tokenizer"):
        assert _rank(OLMO.replace("cfg.save(save_path)", f"{who}.save(save_path)")).severity == "ok"
    f = _rank(OLMO.replace("cfg.save(save_path)", "trainer.save_checkpoint(checkpoint_type)"))
    assert f.severity == "error" and "line 6" in f.message, f  # a checkpoint there still is one


# transformers' older examples (run_glue.py, run_squad.py, run_language_modeling.py before the
# Trainer) and their many forks: -1 is "not distributed", 0 the first process.
HF_LEGACY = """\
import os
import torch
def train(args, model, optimizer, scheduler, global_step):
    if args.local_rank in [-1, 0] and args.save_steps > 0 and global_step % args.save_steps == 0:
        output_dir = os.path.join(args.output_dir, "checkpoint-{}".format(global_step))
        model_to_save = model.module if hasattr(model, "module") else model
        model_to_save.save_pretrained(output_dir)
        torch.save(optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
        torch.save(scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
"""


def test_a_rank_in_minus_one_or_zero_is_a_rank0_test() -> None:
    f = _rank(HF_LEGACY)
    assert f.severity == "warning" and "line 8, 9" in f.message, f  # was "ok"
    assert _rank(HF_LEGACY.replace("[-1, 0]", "(0,)")).severity == "warning"
    assert _rank(HF_LEGACY.replace("in [-1, 0]", "not in [-1, 0]")).severity == "ok"  # the other ranks
    assert _rank(HF_LEGACY.replace("[-1, 0]", "[0, 1]")).severity == "ok"  # not one rank: not decided


# https://github.com/pytorch/torchtune/blob/main/recipes/full_finetune_distributed.py (excerpt):
# the rank-0 test is kept in a flag. The recipe saves on every rank (a collective); moved under
# the flag, as a rank-0 save of a sharded model usually is, it waits forever for the other ranks.
TORCHTUNE = """\
class FullFinetuneRecipeDistributed:
    def __init__(self, cfg):
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
    def save_checkpoint(self, epoch):
        self._checkpoint_client.save_checkpoint(model=self._model, optimizer=self._optimizer,
                                                training_progress=self._progress(epoch), epoch=epoch)
    def train(self):
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            if self._is_rank_zero:
                self._log_metrics(curr_epoch)
            self.save_checkpoint(epoch=curr_epoch)
"""


def test_a_flag_assigned_a_rank0_test_is_a_rank0_test() -> None:
    assert _rank(TORCHTUNE).severity == "ok"  # the recipe as it is
    moved = TORCHTUNE.replace("                self._log_metrics(curr_epoch)\n            self.save_checkpoint",
                              "                self._log_metrics(curr_epoch)\n                self.save_checkpoint")
    f = _rank(moved)
    assert f.severity == "error" and "line 12" in f.message, f  # was "ok"
    plain = "is_main = dist.get_rank() == 0\nif is_main:\n    mgr.save(step, state)\n"
    assert _rank(plain).severity == "error"  # was "ok"
    assert _rank(plain.replace("== 0", "== 1")).severity == "ok"  # rank 1 is no rank 0
    assert _rank(plain.replace("dist.get_rank() == 0", "step % 10 == 0")).severity == "ok"  # no rank at all


# An accelerate training script's save helper (a public script found by code search; the shape is
# common): the state dict is gathered on every rank, then the other ranks return early and rank 0
# writes. Fine for an export; a checkpoint written this way lacks the other ranks' state.
EARLY_RETURN = """\
import os
import torch
def save_model(accelerator, model, optimizer, output_dir):
    full_state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    os.makedirs(output_dir, exist_ok=True)
    torch.save(full_state_dict, os.path.join(output_dir, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
"""


def test_a_save_after_the_other_ranks_returned_is_a_rank0_save() -> None:
    f = _rank(EARLY_RETURN)
    assert f.severity == "warning" and "line 8, 9" in f.message, f  # was "ok"
    loop = "for step in range(9):\n    if dist.get_rank() != 0:\n        continue\n    mgr.save(step, state)\n"
    assert _rank(loop).severity == "error"  # was "ok"
    both = loop.replace("        continue", "        mgr.save(step, state)\n        continue")
    assert _rank(both).severity == "ok"  # the other ranks save before they skip: every rank saves
    zero_returns = EARLY_RETURN.replace("if not accelerator.is_main_process:", "if accelerator.is_main_process:")
    assert _rank(zero_returns).severity == "ok"  # rank 0 leaves, the others save: not a rank-0 save


# transformers' examples/pytorch/*_no_trainer.py (run_clm_no_trainer.py and its forks): the
# accelerate state is saved with accelerator.save_state on every process, as accelerate requires
# (with DeepSpeed or FSDP each process writes its shards); the tokenizer on the main one only.
ACCELERATE = """\
def main():
    for step, batch in enumerate(active_dataloader):
        if isinstance(checkpointing_steps, int):
            if completed_steps % checkpointing_steps == 0:
                output_dir = f"step_{completed_steps}"
                accelerator.save_state(output_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
"""


def test_accelerate_save_state_on_the_main_process_only_is_an_error() -> None:
    assert _rank(ACCELERATE).severity == "ok"  # the example as it is
    main_only = ACCELERATE.replace("                accelerator.save_state(output_dir)",
                                   "                if accelerator.is_main_process:\n"
                                   "                    accelerator.save_state(output_dir)")
    f = _rank(main_only)
    assert f.severity == "error" and "line 7" in f.message, f  # was "ok"
    export = main_only.replace("accelerator.save_state(output_dir)", "accelerator.save(model.state_dict(), output_dir)")
    assert _rank(export).severity == "warning"  # accelerator.save: rank 0's file, an export (held before)
