"""How tests/data/v1 was made (format_version 1). Never regenerate it: old checkpoints must keep
loading, and this fixture proves it. A new format version gets a new folder and a new test."""

from __future__ import annotations

import sys

import torch

import trainguard as tg


def golden_state() -> dict:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4)
        model.bias.copy_(torch.tensor([-1.0, 0.5]))
    return {
        "model": model,
        "progress": tg.StateDict(step=7, tokens=7 * 4096, name="golden", lr=3e-4, done=False),
        "extra": {"tuple": (1, 2.5, "x"), "nan": float("nan"), "ints": {3: "three"}, "half": torch.ones(4, dtype=torch.bfloat16)},
    }


if __name__ == "__main__":
    tg.save(sys.argv[1], golden_state())
