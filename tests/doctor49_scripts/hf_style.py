"""The layout of Hugging Face's run_*_no_trainer.py scripts, without accelerate: epochs, a
completed_steps counter, a resume that skips the batches of the epoch already trained."""
import argparse
import itertools
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
DATA = TensorDataset(torch.randn(320, 10, generator=G), torch.randn(320, 1, generator=G))
BATCH = 16


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def trainguard_state(root="ckpts/hf_style", epochs=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 40), nn.Tanh(), nn.Linear(40, 1))
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=5e-4)
    steps_per_epoch = math.ceil(len(DATA) / BATCH)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, 10, epochs * steps_per_epoch)
    state = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "rng": tg.RNGState(),
             "progress": tg.StateDict(completed_steps=0)}
    return state, {"root": root, "save": tg.EveryNSteps(5), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_train_epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    state, settings = trainguard_state(epochs=args.num_train_epochs)
    model, optimizer, lr_scheduler = state["model"], state["optimizer"], state["lr_scheduler"]
    g = torch.Generator()
    train_dataloader = DataLoader(DATA, batch_size=BATCH, shuffle=True, generator=g)
    num_update_steps_per_epoch = len(train_dataloader)
    with tg.CheckpointManager(**settings) as mgr:
        completed_steps, starting_epoch, resume_step = 0, 0, None
        restored = mgr.restore(state)
        if restored is not None:
            completed_steps = restored
            starting_epoch = completed_steps // num_update_steps_per_epoch
            resume_step = completed_steps % num_update_steps_per_epoch
        for epoch in range(starting_epoch, args.num_train_epochs):
            model.train()
            g.manual_seed(args.seed + epoch)  # the epoch's shuffle order, the same after a resume
            if epoch == starting_epoch and resume_step is not None:
                active_dataloader = itertools.islice(train_dataloader, resume_step, None)
            else:
                active_dataloader = train_dataloader
            for batch in active_dataloader:
                x, y = batch
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                state["progress"]["completed_steps"] = completed_steps
                mgr.save(completed_steps, state)


if __name__ == "__main__":
    main()
