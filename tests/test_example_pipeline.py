"""examples/pipeline.py: real pipeline parallelism (``torch.distributed.pipelining``, GPipe over 2
gloo ranks on 127.0.0.1) checkpointed with ``split_state=True``. Its checkpoint loads into the
whole model on one process without the flag, and a run stopped by SIGTERM and SIGKILLed at a save,
then resumed, ends with the same bytes as a run that never stopped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from test_examples import STOP, _torchrun, differing, kill_at_save
from trainguard.commands.plan import doctor_cmd
from trainguard.commit import read_manifest
from trainguard.export import iter_tensors
from trainguard.storage import for_path

EX = Path(__file__).resolve().parent.parent / "examples"


def _example() -> ModuleType:
    """examples/pipeline.py as a module (its ``trainguard_state`` hook; main() is not run)."""
    spec = importlib.util.spec_from_file_location("pipeline_example", EX / "pipeline.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_whole_model_load(ckpt: Path) -> None:
    """The split checkpoint loads into the whole model, its AdamW, scheduler, sampler and counter
    on one process without ``split_state``; every tensor of the whole model comes from it."""
    ex = _example()
    state, settings = ex.trainguard_state()  # no stage: every layer
    assert settings["split_state"] is False
    whole, opt, sched, sampler, progress = (state[k] for k in ("model", "optim", "sched", "data", "progress"))
    tg.load(str(ckpt), state, only=["model", "optim", "sched", "data", "progress"])
    storage, d = for_path(str(ckpt))
    saved = dict(iter_tensors(storage, d, read_manifest(storage, d), "model"))
    mine = whole.state_dict()
    assert sorted(saved) == sorted(mine) and len(mine) == 2 + 2 * ex.N_LAYERS + 2  # both stages' layers
    assert all(torch.equal(saved[k], v) for k, v in mine.items())
    assert progress["step"] == 9 and sched.last_epoch == 10 and (sampler.epoch, sampler.position) == (2, 16)
    assert len(opt.state) == len(list(whole.parameters()))  # each stage's Adam moments
    assert all(int(s["step"]) == 10 for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_doctor_checks_the_pipeline_examples_state_through_its_hook(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the hook's default root (ckpts/pp) is relative
    res = CliRunner().invoke(doctor_cmd, [str(EX / "pipeline.py"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    found = {f["check"]: f for f in json.loads(res.output)}
    assert {c for c, f in found.items() if f["severity"] != "ok"} == set(), found  # sampler, scheduler, loader generator
    assert {"model", "rng", "data position", "data randomness", "rng after restore"} <= set(found)
    assert not (tmp_path / "ckpts").exists()  # the doctor made no run directory


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of 10 steps that never stopped (one torchrun launch, shared by the tests)."""
    root = tmp_path_factory.mktemp("pipeline") / "a"
    out = _torchrun("pipeline.py", "--dir", str(root), "--steps", "10")
    assert "fresh start" in out and "done at step 9, saved step 9" in out, out
    return root


def test_pipeline_example_checkpoint_loads_into_the_whole_model(straight):
    _check_whole_model_load(straight / "step-000000009")


@pytest.mark.slow  # three more torchrun launches of 2 ranks that each import torch.distributed.pipelining (~30 s on 2 cores)
def test_pipeline_example_resumes_bit_identically(straight, tmp_path):
    b = ["pipeline.py", "--dir", str(tmp_path / "b"), "--steps", "10"]
    out = _torchrun(str(STOP), "4", *b, env={"STOP_RANK": "1"})  # SIGTERM to the last stage alone in step 4
    assert "stopped at step 4, saved step 4" in out or "stopped at step 5, saved step 5" in out, out
    _torchrun(*b, env=kill_at_save(1), ok=False)  # both ranks SIGKILLed as step 6's save begins
    out = _torchrun(*b)
    assert ("resumed from step 4" in out or "resumed from step 5" in out) and "saved step 9" in out, out
    assert differing(straight / "step-000000009", tmp_path / "b" / "step-000000009") == []
