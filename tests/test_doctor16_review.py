"""``trainguard doctor`` on real training scripts, third pass (review): excerpts of popular
scripts as fixtures, each with where it came from."""

from __future__ import annotations

import json

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd
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


# https://github.com/microsoft/DeepSpeedExamples, applications/DeepSpeed-Chat (trimmed): the script
# saves through save_hf_format, a function of the project's own dschat/utils/utils.py, two folders up.
DSCHAT_MAIN = """\
import torch
from dschat.utils.utils import print_rank_0, save_hf_format, save_zero_three_model
def main():
    args.global_rank = torch.distributed.get_rank()
    if args.output_dir is not None:
        print_rank_0('saving the final model ...', args.global_rank)
        if args.global_rank == 0:
            save_hf_format(model, tokenizer, args)
"""
DSCHAT_UTILS = """\
import os
import torch
def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)
def save_hf_format(model, tokenizer, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, 'module') else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    torch.save(model_to_save.state_dict(), os.path.join(output_dir, "pytorch_model.bin"))
    tokenizer.save_vocabulary(output_dir)
"""


def _project(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)


def test_a_save_helper_of_the_projects_own_module_is_followed(tmp_path) -> None:
    main = tmp_path / "training" / "step1_supervised_finetuning" / "main.py"
    _project(tmp_path, {"dschat/__init__.py": "", "dschat/utils/__init__.py": "", "dschat/utils/utils.py": DSCHAT_UTILS,
                        "training/step1_supervised_finetuning/main.py": DSCHAT_MAIN})
    f = single_rank([], Settings(source=DSCHAT_MAIN, path=str(main)))
    assert f is not None and f.severity == "warning" and "line 8" in f.message, f  # was "ok"
    assert "torch.save" in f.message and "save_hf_format" in f.message, f
    res = CliRunner().invoke(doctor_cmd, [str(main), "--json"])  # the command gives the script's path
    found = {x["check"]: x for x in json.loads(res.stdout.splitlines()[0])}
    assert found["all ranks save"]["severity"] == "warning" and "save_hf_format" in found["all ranks save"]["message"]
    assert _rank(DSCHAT_MAIN).severity == "ok"  # no path: the module is out of sight
    # `import m as u` / `from pkg import m` and a collective save in the helper; a helper of a helper.
    sib = tmp_path / "sib"
    _project(sib, {"ckpt.py": "from helpers import write\ndef save_all(m, s):\n    write(m, s)\n",
                   "helpers.py": "def write(m, s):\n    m.save(1, s)\n", "pkg/__init__.py": "",
                   "pkg/io.py": "import torch\ndef dump(x):\n    torch.save(x, 'x.pt')\n"})
    for src, sev in (("import ckpt as c\nif rank == 0:\n    c.save_all(mgr, s)\n", "error"),
                     ("from ckpt import save_all\nif rank == 0:\n    save_all(mgr, s)\n", "error"),
                     ("from pkg import io\nif rank == 0:\n    io.dump(s)\n", "warning"),
                     ("import ckpt\nif rank == 0:\n    other.save_all(mgr, s)\n", "ok"),  # not the module's
                     ("from torch import save_all\nif rank == 0:\n    save_all(mgr, s)\n", "ok")):  # no local file
        f = single_rank([], Settings(source=src, path=str(sib / "train.py")))
        assert f is not None and f.severity == sev, (src, f)


# https://github.com/Lightning-AI/litgpt, litgpt/pretrain.py and litgpt/parser_config.py (trimmed):
# every rank saves the checkpoint with fabric.save; rank 0 then writes the command line's
# hyperparameters.yaml with jsonargparse's parser.save, through a helper of another module.
LITGPT_PRETRAIN = """\
from litgpt.parser_config import save_hyperparameters
def save_checkpoint(fabric, state, tokenizer_dir, checkpoint_file):
    fabric.save(checkpoint_file, state)
    if fabric.global_rank == 0:
        save_hyperparameters(setup, checkpoint_file.parent)
"""
LITGPT_PARSER_CONFIG = """\
from jsonargparse import capture_parser
def save_hyperparameters(function, checkpoint_dir, known_commands=None):
    parser = capture_parser(lambda: CLI(function))
    config = parser.parse_args()
    parser.save(config, checkpoint_dir / "hyperparameters.yaml", overwrite=True)
"""


def test_a_config_file_written_on_rank0_through_a_helper_is_no_checkpoint(tmp_path) -> None:
    _project(tmp_path, {"litgpt/__init__.py": "", "litgpt/parser_config.py": LITGPT_PARSER_CONFIG,
                        "litgpt/pretrain.py": LITGPT_PRETRAIN})
    f = single_rank([], Settings(source=LITGPT_PRETRAIN, path=str(tmp_path / "litgpt" / "pretrain.py")))
    assert f is not None and f.severity == "ok", f  # was an error: "save called (in save_hyperparameters)"
    # in the script itself too, and whatever the receiver is named
    for text in ("    parser.save(config, 'hparams.yaml')\n", "    writer.save(cfg, out / 'config.json')\n"):
        assert _rank(f"if rank == 0:\n{text}").severity == "ok", text
    assert _rank("if rank == 0:\n    writer.save(state, out / 'model.pt')\n").severity == "error"


def test_the_modules_followed_are_bounded(tmp_path) -> None:
    # Two imports deep: script -> m0 -> m1 is followed, m1 -> m2 is not; a cycle back ends there too.
    # (m1 imported by the script itself is one import deep: its m2 is followed, test_newcode16b_review.py)
    _project(tmp_path, {"m0.py": "from m1 import f1, g1\ndef f0(x):\n    f1(x)\ndef h0(x):\n    g1(x)\n",
                        "m1.py": "import train\nfrom m2 import f2\ndef f1(x):\n    torch.save(x, 'a.pt')\n"
                                 "def g1(x):\n    f2(x)\n",
                        "m2.py": "def f2(x):\n    torch.save(x, 'b.pt')\n",
                        "train.py": "from m0 import f0, h0\n"})
    for call, sev in (("f0(s)", "warning"), ("h0(s)", "ok")):
        src = f"from m0 import f0, h0\nif rank == 0:\n    {call}\n"
        f = single_rank([], Settings(source=src, path=str(tmp_path / "train.py")))
        assert f is not None and f.severity == sev, (call, f)
    # At most 32 files: a helper in the 40th module the script imports is out of reach.
    _project(tmp_path / "many", {f"k{i:02d}.py": f"def f{i}(x):\n    torch.save(x, 'a.pt')\n" for i in range(40)})
    src = "".join(f"from k{i:02d} import f{i}\n" for i in range(40)) + "if rank == 0:\n    f{}(s)\n"
    for i, sev in ((0, "warning"), (31, "warning"), (39, "ok")):
        f = single_rank([], Settings(source=src.format(i), path=str(tmp_path / "many" / "train.py")))
        assert f is not None and f.severity == sev, (i, f)


# https://github.com/NVIDIA/Megatron-LM, megatron/core/dist_checkpointing/strategies/common.py
# (trimmed): its folder also holds a torch.py (the torch strategy), and msc_utils a method named save;
# the rank-0 torch.save there is still torch's.
MEGATRON_COMMON = """\
import torch
from megatron.core.msc_utils import maybe_msc
def save_common(common_state_dict, checkpoint_dir):
    if torch.distributed.get_rank() == 0:
        maybe_msc.torch.save(common_state_dict, checkpoint_dir + '/common.pt')
"""


def test_a_module_named_like_torch_next_to_a_module_is_not_torch(tmp_path) -> None:
    strategies = "megatron/core/dist_checkpointing/strategies"
    _project(tmp_path, {"megatron/__init__.py": "", "megatron/core/__init__.py": "",
                        "megatron/core/msc_utils.py": "class Msc:\n    def save(self, x, p):\n        self.client.save(x, p)\n",
                        f"{strategies}/__init__.py": "", f"{strategies}/common.py": MEGATRON_COMMON,
                        f"{strategies}/torch.py": "import torch\ndef save(x, p):\n    writer.save(x, p)\n"})
    train = tmp_path / "train.py"  # a script importing the module: `import torch` there is torch
    src = "from megatron.core.dist_checkpointing.strategies.common import save_common\nif rank == 0:\n    save_common(s, d)\n"
    f = single_rank([], Settings(source=src, path=str(train)))
    assert f is not None and f.severity == "warning" and "torch.save" in f.message, f
    f = single_rank([], Settings(source=MEGATRON_COMMON, path=str(tmp_path / strategies / "common.py")))
    assert f is not None and f.severity == "warning" and "torch.save" in f.message, f  # was an error: "(in save)"
