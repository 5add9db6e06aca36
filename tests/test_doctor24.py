"""The doctor's "after restore" check, session 24: a model (or any object of the state) built anew
after the restore, so that training goes on with fresh weights while the restored object sits
unused. Seen in the run below: the loss after a resume was that of step 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.doctor import Settings, check
from trainguard.doctor_source import check_source

REBUILT = """
import torch
import trainguard as tg

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(4, 1)
    def forward(self, x): return self.fc(x)

def main(root, steps):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(5)) as mgr:
        start = mgr.restore(state)
        model = Net()
        first = 0 if start is None else start + 1
        for step in range(first, steps):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            mgr.save(step, state)
    return model
"""


def findings(src: str, hooked: bool = False) -> list:
    s = Settings(source=textwrap.dedent(src))
    return [f for f in (check({}, s) if hooked else check_source(s)) if f.check == "after restore"]


def test_a_model_built_anew_after_the_restore_is_a_warning() -> None:
    for hooked in (False, True):
        (f,) = findings(REBUILT, hooked)
        assert f.severity == "warning" and "line 16: Net() after the restore builds a new object" in f.message, f
        assert "before mgr.restore(state)" in f.fix
    hf = REBUILT.replace("        model = Net()\n        first", "        model = AutoModel.from_pretrained('gpt2')\n        first")
    (f,) = findings(hf)
    assert f.severity == "warning" and "AutoModel.from_pretrained('gpt2')" in f.message, f
    sampler = REBUILT.replace('"optim": opt}', '"optim": opt, "data": sampler}').replace(
        "        model = Net()\n        first", "        sampler = tg.ResumableSampler(range(10))\n        first")
    (f,) = findings(sampler)
    assert f.severity == "warning" and "line 16: tg.ResumableSampler(range(10))" in f.message, f


@pytest.mark.parametrize("line", [
    "model = torch.nn.parallel.DistributedDataParallel(model)",
    "model = torch.compile(model)",
    "model = model.to('cpu')",
    "model = FSDP(model, use_orig_params=True)",
    "loss_fn = torch.nn.MSELoss()",  # not in the state
    "if start is None:\n            model = Net()",  # a fresh start only
])
def test_a_wrapper_another_object_or_a_fresh_start_only_is_not_reported(line: str) -> None:
    (f,) = findings(REBUILT.replace("        model = Net()\n        first", f"        {line}\n        first"))
    assert f.severity == "ok", (line, f)


def test_the_script_trains_fresh_weights_on_each_resume(tmp_path: Path) -> None:
    """What the warning is about, run: a checkpoint of step 5 trained by the fixed script; the
    script with Net() after the restore resumes there and hands back fresh weights, the fixed one
    the restored ones."""
    tail = textwrap.dedent("""
        import sys
        torch.manual_seed(int(sys.argv[2]))
        print(float(main(sys.argv[1], 6).fc.bias))
    """)
    fixed, rebuilt = tmp_path / "fixed.py", tmp_path / "rebuilt.py"
    fixed.write_text(textwrap.dedent(REBUILT).replace("        model = Net()\n", "", 1) + tail)  # the one after the restore
    rebuilt.write_text(textwrap.dedent(REBUILT) + tail)

    def bias(script: Path, seed: int) -> float:
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(seed)], capture_output=True,
                             text=True, timeout=300, check=True)
        return float(out.stdout.split()[-1])

    trained = bias(fixed, 0)  # steps 0..5, step 5 saved
    assert bias(rebuilt, 1) != trained  # resumed at step 5, nothing left to train: a fresh Net()'s bias
    assert bias(fixed, 1) == trained  # resumed: the restored weights


ONE_FILE = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for epoch in range(3):
        model(torch.ones(2, 4)).sum().backward()
        torch.save(model.state_dict(), "ckpt.pt")
"""


def one_file(src: str) -> list:
    s = Settings(source=textwrap.dedent(src))
    return [f for f in check_source(s) if f.check == "one file, every rank"]


def test_every_rank_saving_to_one_path_is_a_warning() -> None:
    (f,) = one_file(ONE_FILE)
    assert f.severity == "warning" and "line 13: torch.save(model.state_dict(), 'ckpt.pt') runs on every rank" in f.message
    assert "if dist.get_rank() == 0" in f.fix
    kw = ONE_FILE.replace('torch.save(model.state_dict(), "ckpt.pt")', 'torch.save(model.state_dict(), f=path)').replace(
        '    rank = dist.get_rank()\n', '    rank = dist.get_rank()\n    path = "out/model.pt"\n')
    (f,) = one_file(kw)
    assert f.severity == "warning" and "f=path" in f.message, f


@pytest.mark.parametrize("changes", [
    [('        torch.save(', '        if rank == 0:\n            torch.save(')],
    [('        torch.save(', '        if not dist.get_rank():\n            torch.save(')],
    [('        torch.save(', '        if rank != 0:\n            continue\n        torch.save(')],
    [('"ckpt.pt"', 'f"ckpt-{rank}.pt"')],
    [('"ckpt.pt"', 'out'), ('    model = DDP', '    out = f"ckpts/{rank}.pt"\n    model = DDP')],  # a name made per rank
    [('"ckpt.pt"', 'out'), ('    model = DDP', '    out = os.path.join("ckpts", f"r{dist.get_rank()}.pt")\n    model = DDP')],
    [('        torch.save(model.state_dict(), "ckpt.pt")',  # a helper of the script called on rank 0 only
      '        if rank == 0:\n            snapshot(model)\n\ndef snapshot(model):\n    torch.save(model.state_dict(), "ckpt.pt")')],
])
def test_a_guarded_or_per_rank_save_is_not_reported(changes: list[tuple[str, str]]) -> None:
    src = ONE_FILE
    for old, new in changes:
        assert old in src
        src = src.replace(old, new)
    (f,) = one_file(src)
    assert f.severity == "ok", (src, f)


def test_a_script_that_starts_no_process_group_is_not_checked() -> None:
    plain = ONE_FILE.replace('    dist.init_process_group("gloo")\n', "").replace("DDP(torch", "(torch")
    assert one_file(plain) == []


def test_a_save_on_the_first_gpus_process_of_a_spawned_script_is_not_reported() -> None:
    """pytorch/examples' multigpu.py: mp.spawn passes the rank as ``gpu_id``; the save runs under
    ``if self.gpu_id == 0 and epoch % self.save_every == 0:`` through a method of the trainer."""
    src = ONE_FILE.replace('        torch.save(model.state_dict(), "ckpt.pt")',
                           '        if gpu_id == 0 and epoch % 2 == 0:\n            save(model)\n\n'
                           'def save(model):\n    torch.save(model.state_dict(), "ckpt.pt")')
    assert "gpu_id == 0" in src
    (f,) = one_file(src)
    assert f.severity == "ok", f
    (f,) = one_file(src.replace("gpu_id == 0", "gpu_id != 0"))  # every GPU's process but the first: still one path
    assert f.severity == "warning", f
