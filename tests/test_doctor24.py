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
