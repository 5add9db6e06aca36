"""How tests/data/compat_bc81a74 was made: a CheckpointManager run of trainguard at commit bc81a74
(the first core engine, 2026-11-30; format_version 1, optimizer entries without ``"class"``)
with a model, AdamW, StepLR, GradScaler, RNGState and a StateDict, saved at steps 2 and 4
(KeepLatest(2)), plus ``expected.pt``: the state at step 4 as plain tensors and lists. Never
regenerate it with a newer trainguard: ``tests/test_compat_review.py`` proves that a run
directory an old version wrote restores bit for bit and keeps saving.

``git worktree add --detach /tmp/old bc81a74 && PYTHONPATH=/tmp/old/src python
tests/data/make_compat_bc81a74.py tests/data/compat_bc81a74``
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

import trainguard as tg


def build() -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.3), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {
        "model": model,
        "optim": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
        "rng": tg.RNGState(),
        "progress": tg.StateDict(step=-1),
    }


def train_step(state: dict, step: int) -> None:
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = torch.nn.functional.cross_entropy(state["model"](x), y)
    state["optim"].zero_grad()
    state["scaler"].scale(loss).backward()
    state["scaler"].step(state["optim"])
    state["scaler"].update()
    state["sched"].step()
    state["progress"]["step"] = step


def snapshot(state: dict) -> dict:
    """The whole state as tensors, ints and lists (``torch.load(weights_only=True)`` reads it)."""
    opt = state["optim"].state_dict()
    return {
        "model": dict(state["model"].state_dict()),
        "optim": {f"{i}.{k}": v for i, s in opt["state"].items() for k, v in s.items()},
        "lr": [g["lr"] for g in opt["param_groups"]],
        "sched": state["sched"].state_dict()["last_epoch"],
        "scale": state["scaler"].get_scale(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": list(random.getstate()[1]),
        "np_rng": np.random.get_state()[1].tolist(),
        "step": state["progress"]["step"],
    }


if __name__ == "__main__":
    state = build()
    with tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(2), keep=tg.KeepLatest(2)) as mgr:
        for step in range(5):
            train_step(state, step)
            mgr.save(step, state)
    torch.save(snapshot(state), f"{sys.argv[1]}/expected.pt")
