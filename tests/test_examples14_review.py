"""Review of the examples and docs snippets (examples14): ``trainguard doctor`` on every example
goes through its ``trainguard_state()`` hook and finds no error, and the README's training loop,
SIGKILLed at a save and restarted, ends bit-identical to a run that never stopped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_examples import EX, differing, kill_at_save
from trainguard.commands.plan import doctor_cmd

from conftest import run_py

ROOT = Path(__file__).resolve().parent.parent
# Warnings each example explains in its docstring: batches drawn from the saved RNG (no sampler),
# a constant learning rate (no scheduler).
EXPLAINED = {"data position", "optimizer+scheduler"}


@pytest.mark.parametrize("script", ["plain_loop.py", "ddp_torchrun.py", "fsdp2.py", "hf_transformers.py", "ddp_gpt.py"])
def test_doctor_checks_every_examples_state_through_its_hook(script, tmp_path, monkeypatch):
    if script == "hf_transformers.py":
        pytest.importorskip("transformers", reason="transformers is not installed")
    monkeypatch.chdir(tmp_path)  # the hooks' default roots (ckpts/...) are relative
    res = CliRunner().invoke(doctor_cmd, [str(EX / script), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    found = {f["check"]: f for f in json.loads(res.output)}
    assert found["model"]["severity"] == "ok" and found["rng"]["severity"] == "ok"  # the hook's state was checked
    assert found["rng after restore"]["severity"] == "ok"
    assert {c for c, f in found.items() if f["severity"] != "ok"} <= EXPLAINED, found
    assert not (tmp_path / "ckpts").exists()  # the doctor made no run directory


@pytest.mark.slow  # suite time (~13 s); test_docs runs the README loop, test_examples the plain loop's SIGKILL resume
def test_readme_training_loop_resumes_bit_identically_after_sigkill(tmp_path):
    """README's "Use it" loop (30 steps, a save every 10): SIGKILLed as step 20's save begins and
    restarted in a process seeded otherwise, its step-20 checkpoint equals the straight run's."""
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    assert "mgr.restore(state)" in code and "tg.RNGState()" in code
    prog = ("import sys, torch\ntorch.manual_seed(int(sys.argv[1]))\n"  # the same initial weights for a and b's first run
            f"exec(compile({code!r}, 'README.md', 'exec'), {{'__name__': '__doc_example__'}})\n")
    runs = [("a", "0", None), ("b", "0", kill_at_save(2)), ("b", "7", None)]
    for name, seed, env in runs:
        (tmp_path / name).mkdir(exist_ok=True)
        r = run_py(["-c", f"import os; os.chdir({str(tmp_path / name)!r})\n" + prog, seed], env=env, timeout=120)
        assert r.returncode == (-9 if env else 0), r.stderr[-3000:]
    run = Path("ckpts/run1/step-000000020")
    assert differing(tmp_path / "a" / run, tmp_path / "b" / run) == []
