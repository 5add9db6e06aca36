"""An accelerate-style loop, written out without accelerate: a small Accelerator stand-in that
handles gradient accumulation, a skip of the batches already trained in the resumed epoch."""
import argparse
import contextlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
DATA = TensorDataset(torch.randn(200, 6, generator=G), torch.randn(200, 2, generator=G))


class Accelerator:
    """What this script uses of accelerate's: backward with accumulation, sync_gradients."""

    def __init__(self, gradient_accumulation_steps=1):
        self.gradient_accumulation_steps, self.micro, self.sync_gradients = gradient_accumulation_steps, 0, True

    @contextlib.contextmanager
    def accumulate(self):
        self.micro += 1
        self.sync_gradients = self.micro % self.gradient_accumulation_steps == 0
        yield

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()


def trainguard_state(root="ckpts/accel"):
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=40, power=2.0)
    state = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "rng": tg.RNGState(),
             "progress": tg.StateDict(completed_steps=0)}
    return state, {"root": root, "save": tg.EveryNSteps(4), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_train_epochs", type=int, default=4)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    args = ap.parse_args()
    accelerator = Accelerator(args.gradient_accumulation_steps)
    state, settings = trainguard_state()
    model, optimizer, lr_scheduler = state["model"], state["optimizer"], state["lr_scheduler"]
    progress = state["progress"]
    g = torch.Generator()
    train_dataloader = DataLoader(DATA, batch_size=10, shuffle=True, generator=g)
    updates_per_epoch = len(train_dataloader) // args.gradient_accumulation_steps
    with tg.CheckpointManager(**settings) as mgr:
        mgr.restore(state)
        starting_epoch = progress["completed_steps"] // updates_per_epoch
        resume_step = (progress["completed_steps"] % updates_per_epoch) * args.gradient_accumulation_steps
        for epoch in range(starting_epoch, args.num_train_epochs):
            g.manual_seed(1234 + epoch)
            for step, (x, y) in enumerate(train_dataloader):
                if epoch == starting_epoch and step < resume_step:
                    continue
                with accelerator.accumulate():
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        optimizer.step()
                        lr_scheduler.step()
                        optimizer.zero_grad()
                if accelerator.sync_gradients:
                    progress["completed_steps"] += 1
                    mgr.save(progress["completed_steps"], state)


if __name__ == "__main__":
    main()
