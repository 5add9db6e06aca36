"""Gradient accumulation: 4 micro-batches per optimizer step; a save after each optimizer step."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
DATA = TensorDataset(torch.randn(512, 16, generator=G), torch.randint(0, 4, (512,), generator=G))
ACCUM = 4


def trainguard_state(root="ckpts/accum"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=64)
    sampler = tg.ResumableSampler(DATA, seed=1)
    state = {"model": model, "optimizer": opt, "lr_scheduler": sched, "sampler": sampler,
             "rng": tg.RNGState(), "meta": tg.StateDict(global_step=0)}
    return state, {"root": root, "save": tg.EveryNSteps(8), "keep": tg.KeepLatest(3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    state, settings = trainguard_state()
    model, opt, sched, sampler = state["model"], state["optimizer"], state["lr_scheduler"], state["sampler"]
    loader = DataLoader(DATA, batch_size=4, sampler=sampler, generator=torch.Generator())
    with tg.CheckpointManager(**settings) as mgr:
        resumed = mgr.restore(state)
        global_step = 0 if resumed is None else resumed
        while sampler.epoch < args.epochs:
            for i, (x, y) in enumerate(loader):
                loss = nn.functional.cross_entropy(model(x), y) / ACCUM
                loss.backward()
                sampler.advance(len(x))
                if (i + 1) % ACCUM == 0:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    global_step += 1
                    state["meta"]["global_step"] = global_step
                    mgr.save(global_step, state)
            sampler.next_epoch()


if __name__ == "__main__":
    main()
