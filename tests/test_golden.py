"""Old formats stay loadable: tests/data/v1 was written by format_version 1 and is never regenerated."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import trainguard as tg

V1 = Path(__file__).parent / "data" / "v1" / "step-000000007"


def test_format_v1_fixture_loads_and_verifies():
    assert tg.verify(V1).ok
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "progress": tg.StateDict(), "extra": None}
    tg.load(V1, state)
    assert torch.equal(model.weight, torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4)
    assert torch.equal(model.bias, torch.tensor([-1.0, 0.5]))
    assert dict(state["progress"]) == {"step": 7, "tokens": 7 * 4096, "name": "golden", "lr": 3e-4, "done": False}
    extra = state["extra"]
    assert extra["tuple"] == (1, 2.5, "x") and math.isnan(extra["nan"]) and extra["ints"] == {3: "three"}
    assert extra["half"].dtype == torch.bfloat16 and torch.equal(extra["half"], torch.ones(4, dtype=torch.bfloat16))
    assert tg.inspect.describe(V1).format_version == 1
