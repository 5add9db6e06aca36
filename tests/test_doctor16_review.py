"""``trainguard doctor`` on real training scripts, third pass (review): excerpts of popular
scripts as fixtures, each with where it came from."""

from __future__ import annotations

from trainguard.doctor import Finding, Settings
from trainguard.doctor_source import single_rank


def _rank(src: str) -> Finding:
    f = single_rank([], Settings(source=src))
    assert f is not None
    return f


# https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/training/checkpointing.py (save_checkpoint,
# trimmed): every rank enters the branch unless the checkpoint is LEGACY, where the first rank of each
# data-parallel group writes its model shard with torch.save; the sharded saves are every rank's.
MEGATRON = """\
import torch
from megatron.core import dist_checkpointing, mpu
def save_checkpoint(iteration, model, optimizer, ckpt_type, args, skip_weight_ckpt=False):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dp_rank = 0
    expt_dp_rank = 0
    if torch.distributed.is_initialized():
        dp_rank = mpu.get_data_parallel_rank()
        expt_dp_rank = mpu.get_expert_data_parallel_rank()
    if not skip_weight_ckpt and (
        not torch.distributed.is_initialized()
        or ckpt_type != CheckpointType.LEGACY
        or dp_rank == 0
        or expt_dp_rank == 0
    ):
        state_dict = generate_state_dict(args, model, optimizer)
        if ckpt_type == CheckpointType.GLOBAL and args.ckpt_format == 'torch_dist':
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                ensure_directory_exists(checkpoint_name, check_parent=False)
            async_save_request = dist_checkpointing.save(state_dict, checkpoint_name, save_strategy)
        else:
            torch.save(state_dict, checkpoint_name)
"""


def test_a_rank0_test_or_a_mode_where_every_rank_saves_is_no_rank0_save() -> None:
    f = _rank(MEGATRON)
    assert f.severity == "ok", f  # was an error: "save called under a rank-0 condition (line 19)"
    # Or-ed with "not distributed" alone, the test still holds on rank 0 only (one process, or rank 0).
    single = "import torch.distributed as dist\nif not dist.is_initialized() or dist.get_rank() == 0:\n    mgr.save(1, s)\n"
    assert _rank(single).severity == "error"
    for alone in ("not args.distributed", "args.local_rank == -1", "dist.get_world_size() == 1", "world_size < 2"):
        assert _rank(single.replace("not dist.is_initialized()", alone)).severity == "error", alone
    assert _rank(single.replace("not dist.is_initialized()", "args.save_on_each_rank")).severity == "ok"


# Rank-0 tests spelled in other ways: torch_xla's xm.is_master_ordinal() (pytorch/xla's test_train_mp_*
# examples), accelerate's accelerator.is_local_main_process (the first process of each machine), an
# assignment expression, and a match statement on the rank.
def test_more_spellings_of_a_rank0_test_are_read() -> None:
    for test in ("xm.is_master_ordinal()", "accelerator.is_local_main_process", "trainer.is_world_process_zero()",
                 "(r := dist.get_rank()) == 0", "(is_main := dist.get_rank() == 0)"):
        f = _rank(f"if {test}:\n    mgr.save(step, state)\n")
        assert f.severity == "error" and "line 2" in f.message, (test, f)  # was "ok"
    walrus = "if (r := dist.get_rank()) == 0:\n    pass\nif r == 0:\n    mgr.save(step, state)\n"
    assert _rank(walrus).severity == "error"  # r is the rank from then on
    match = ("match dist.get_rank():\n    case 0:\n        mgr.save(step, state)\n    case _:\n        pass\n")
    f = _rank(match)
    assert f.severity == "error" and "line 3" in f.message, f  # was "ok"
    both = match.replace("        pass", "        mgr.save(step, state)")
    assert _rank(both).severity == "ok"  # every rank saves, in one case or the other
    assert _rank(match.replace("case 0:", "case 1:")).severity == "ok"
    assert _rank(match.replace("case 0:", "case 0 if step % 100 == 0:")).severity == "error"
    assert _rank(match.replace("dist.get_rank()", "phase")).severity == "ok"
    assert _rank(match.replace("mgr.save", "torch.save")).severity == "warning"


def _reseed(src: str) -> Finding:
    from trainguard.doctor_rng import reseed

    f = reseed([], Settings(source=src))
    assert f is not None
    return f


# The shape of HF's run_*_no_trainer.py examples (transformers/examples/pytorch), with the seed moved
# after the resume: accelerate's load_state puts back the random, numpy, torch and cuda generators
# that save_state wrote, and set_seed then overwrites them.
ACCELERATE = """\
from accelerate import Accelerator
from accelerate.utils import set_seed
def main(args):
    accelerator = Accelerator()
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
    set_seed(args.seed)
    for epoch in range(args.num_train_epochs):
        train(model, train_dataloader)
"""


def test_accelerate_load_state_is_a_restore_for_the_seed_check() -> None:
    f = _reseed(ACCELERATE)
    assert f.severity == "warning" and "line 8" in f.message, f  # was None: no restore seen
    before = ACCELERATE.replace("    set_seed(args.seed)\n", "").replace("    accelerator = Accelerator()\n",
                                                                       "    set_seed(args.seed)\n    accelerator = Accelerator()\n")
    assert _reseed(before).severity == "ok"  # HF's own order: seed first
    from trainguard.doctor_rng import reseed

    other = ACCELERATE.replace("accelerator.load_state", "cache.load_state")  # not accelerate's: no restore seen
    assert reseed([], Settings(source=other)) is None
