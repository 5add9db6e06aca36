"""Epochs over a DataLoader with DistributedSampler (torchrun), a save at the end of each epoch."""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
DATA = TensorDataset(torch.randn(128, 12, generator=G), torch.randint(0, 3, (128,), generator=G))


def trainguard_state(root="ckpts/epoch_ddp", ddp=False):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Linear(48, 3))
    model = DDP(net) if ddp else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "rng": tg.RNGState(),
             "progress": tg.StateDict(epoch=0)}
    return state, {"root": root, "save": tg.EveryNSteps(1), "keep": tg.KeepLatest(2)}


def train_one_epoch(model, loader, optimizer):
    model.train()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    state, settings = trainguard_state(ddp=True)
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    sampler = DistributedSampler(DATA, shuffle=True, seed=0)
    loader = DataLoader(DATA, batch_size=8, sampler=sampler, generator=torch.Generator())
    with tg.CheckpointManager(**settings) as mgr:
        last = mgr.restore(state)
        start_epoch = 0 if last is None else last + 1
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            train_one_epoch(model, loader, optimizer)
            scheduler.step()
            state["progress"]["epoch"] = epoch
            mgr.save(epoch, state)
            if mgr.should_stop:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
