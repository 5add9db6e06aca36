"""How tests/data/ac_wrapped was made: trainguard at 7606fc8 (before ``names.py``) kept
activation checkpointing's ``_checkpoint_wrapped_module`` in optimizer parameter names. Never
regenerate it (with today's code it would hold the names without the wrapper): it proves such
checkpoints still load.

``PYTHONPATH=src python tests/data/make_ac_wrapped.py tests/data/ac_wrapped/step-000000003``
(run on the code of 7606fc8)
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import trainguard as tg


def build(wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if wrap:
        m[0] = checkpoint_wrapper(m[0])
    return m, torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)


def step(m: nn.Module, o: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(100 + i)
    loss = m(torch.randn(5, 6, generator=g)).square().mean()
    o.zero_grad()
    loss.backward()
    o.step()
    return loss.item()


if __name__ == "__main__":
    model, optim = build(True)
    for i in range(3):
        step(model, optim, i)
    tg.save(sys.argv[1], {"model": model, "optim": optim})
