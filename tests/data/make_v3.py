"""How tests/data/v3 was made (format_version 3: a tie stored once, its second name an alias).
Never regenerate it: old checkpoints must keep loading, and this fixture proves it.

``PYTHONPATH=src python tests/data/make_v3.py tests/data/v3/step-000000003``
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import trainguard as tg


class TiedLM(nn.Module):
    """``head.weight`` IS ``emb.weight``; ``state_dict()`` lists ``emb`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


def golden_model() -> TiedLM:
    model = TiedLM()
    with torch.no_grad():
        model.emb.weight.copy_(torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8 - 1)
        model.norm.weight.copy_(torch.tensor([1.0, 0.5, 2.0, -1.0]))
        model.norm.bias.copy_(torch.tensor([0.0, 0.25, -0.25, 3.0]))
    return model


def golden_extra() -> dict:
    w = torch.arange(10, dtype=torch.int32)
    return {"w": w, "same": w, "part": w[2:5]}  # a tie in a plain dict; a view that only overlaps


if __name__ == "__main__":
    tg.save(sys.argv[1], {"model": golden_model(), "progress": tg.StateDict(step=3), "extra": golden_extra()})
