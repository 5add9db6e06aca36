"""Public calls whose hints (the package ships ``py.typed``) or checks disagreed with what they take.

Found with mypy over src/trainguard and over a user's script that calls the public API the way the docs
show: ``tg.doctor(state, source=Path(__file__))`` raised TypeError "pass the training script's text or its
path" for the script's path; ``CheckpointManager.save(metrics={"loss": loss})`` (a tensor, "common" per
metricvals.py) and ``CheckpointManager(ram_tier=Path(...))`` (checked as os.PathLike at run time) ran, but
a type-checked script got an error for each, as the hints said float and ``bool | str``.
"""

from __future__ import annotations

import types
import typing
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainguard as tg

_SCRIPT = """import torch
model = torch.nn.Linear(2, 2)
opt = torch.optim.AdamW(model.parameters())
noise = torch.Generator()
for step in range(10):
    x = torch.randn(2, 2, generator=noise)
    opt.step()
"""


def _admits(hint: Any, value: Any) -> bool:
    """Whether ``value``'s class is one of the members of ``hint`` (a class, generic alias or union of them)."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(isinstance(value, typing.get_origin(m) or m) for m in members if m is not Any)


def test_doctor_reads_a_pathlib_path_of_the_script(tmp_path: Path) -> None:
    state = {"model": torch.nn.Linear(2, 2)}

    def flagged(source: Any) -> set[str]:
        return {f.check for f in tg.doctor(state, source=source) if f.severity != "ok"}

    want = flagged(_SCRIPT)
    assert {"optimizer+scheduler", "own generators"} <= want
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "train").write_text(_SCRIPT)  # a script without the suffix: a Path says it is a path
    assert flagged(tmp_path / "train.py") == flagged(tmp_path / "train") == want  # before: TypeError
    with pytest.raises(FileNotFoundError, match=r"nope\.py'?: no such file"):
        tg.doctor(state, source=tmp_path / "nope.py")
    assert _admits(typing.get_type_hints(tg.doctor)["source"], tmp_path / "train.py")
    with pytest.raises(TypeError, match=r"source=1: pass the training script's text or its path"):
        tg.doctor(state, source=1)  # type: ignore[arg-type]


def test_manager_hints_admit_a_path_ram_tier_and_tensor_metrics_that_it_takes(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    state = {"model": model}
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", n=2),
                              handle_signals=False) as mgr:
        for step, loss in ((1, torch.tensor(0.5)), (2, np.float32(0.25)), (3, torch.tensor([0.75])), (4, 0.125)):
            mgr.save(step, state, metrics={"loss": loss})
        mgr.wait()
    kept = sorted(p.name for p in (tmp_path / "run").glob("step-*"))
    assert "step-000000003" not in kept and {"step-000000002", "step-000000004"} <= set(kept)  # ranked by the values
    ram = tmp_path / "ram"
    ram.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ram_tier on a disk, not a tmpfs: warned at open
        with tg.CheckpointManager(tmp_path / "run2", save=tg.EveryNSteps(1), ram_tier=ram, handle_signals=False) as mgr:
            mgr.save(1, state)
            assert mgr.ram is not None and any(ram.iterdir())  # the Path was taken as the RAM tier's directory
    init_hints = typing.get_type_hints(tg.CheckpointManager.__init__)
    assert _admits(init_hints["ram_tier"], ram)  # before: bool | str
    metric = typing.get_args(_members_not_none(typing.get_type_hints(tg.CheckpointManager.save)["metrics"]))[1]
    for value in (torch.tensor(0.5), np.float32(0.25), np.array([0.75]), 0.5):
        assert _admits(metric, value), (metric, type(value))  # before: float


def _members_not_none(hint: Any) -> Any:
    (only,) = [m for m in typing.get_args(hint) if m is not type(None)]
    return only
