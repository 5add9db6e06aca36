"""A small but complete training setup for tests: dropout, AdamW, warmup+cosine LR, GradScaler,
shuffled DataLoader whose position is part of the saved state. Run as a script it trains and
checkpoints with a CheckpointManager, so tests can kill and resume it in new processes."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys

import numpy as np
import torch
from torch import nn

import trainguard as tg

STEPS_PER_EPOCH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def make_data(n: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def build(total_steps: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    warm = 5

    def lr_lambda(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "scaler": scaler,
        "rng": tg.RNGState(),
        "progress": tg.StateDict(step=0),
    }


def batches_from(data: torch.utils.data.Dataset, step: int):
    """Batches from global step ``step`` on: the epoch's order comes from (seed, epoch)."""
    epoch, skip = divmod(step, STEPS_PER_EPOCH)
    while True:
        g = torch.Generator().manual_seed(1000 + epoch)
        loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=g)
        yield from itertools.islice(loader, skip, None)
        epoch, skip = epoch + 1, 0


def train(state: dict, start: int, stop: int, mgr: tg.CheckpointManager | None = None) -> list[float]:
    model, opt, sched, scaler = state["model"], state["optim"], state["sched"], state["scaler"]
    data = make_data()
    losses = []
    it = batches_from(data, start)
    for step in range(start, stop):
        x, y = next(it)
        x = x + 0.01 * torch.randn_like(x) + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
        state["progress"]["step"] = step + 1
        if mgr is not None:
            mgr.save(step + 1, state)
    return losses


def snapshot(state: dict) -> dict:
    """Everything that must match bit for bit, as plain tensors/values."""
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optim"].state_dict()["state"].values()):
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    out["lr"] = torch.tensor(state["sched"].get_last_lr())
    out["scale"] = torch.tensor(state["scaler"].get_scale())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--stop", type=int, required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    state = build(a.total)
    with tg.CheckpointManager(a.root, save=tg.EveryNSteps(a.every), keep=tg.KeepLatest(2)) as mgr:
        start = mgr.restore(state) or 0
        losses = train(state, start, a.stop, mgr)
    torch.save(snapshot(state), a.out + ".pt")
    with open(a.out + ".json", "w") as f:
        json.dump({"start": start, "losses": losses}, f)


if __name__ == "__main__":
    sys.exit(main())
