"""torchtitan's layout: a TrainState object saved with the rest, a while loop on its step."""
import argparse
from dataclasses import dataclass

import torch
from torch import nn

import trainguard as tg


@dataclass
class TrainState:
    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


class TokenStream:
    """A synthetic token stream that can say where it is."""

    def __init__(self, seq_len=16, batch=4):
        self.seq_len, self.batch, self.position = seq_len, batch, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        return torch.randint(0, 100, (self.batch, self.seq_len + 1), generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = int(sd["position"])


def trainguard_state(root="ckpts/titan"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))
    optimizers = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), fused=False)
    lr_schedulers = torch.optim.lr_scheduler.LinearLR(optimizers, start_factor=0.1, total_iters=10)
    state = {"model": model, "optimizer": optimizers, "lr_scheduler": lr_schedulers,
             "dataloader": TokenStream(), "train_state": TrainState(), "rng": tg.RNGState()}
    return state, {"root": root, "save": tg.EveryNSteps(10), "keep": tg.KeepLatest(3), "async_save": True}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--training.steps", dest="steps", type=int, default=50)
    args = ap.parse_args()
    states, settings = trainguard_state()
    model, optimizers, lr_schedulers = states["model"], states["optimizer"], states["lr_scheduler"]
    data, train_state = states["dataloader"], states["train_state"]
    with tg.CheckpointManager(**settings) as checkpoint:
        checkpoint.restore(states)
        while train_state.step < args.steps:
            train_state.step += 1
            batch = data.next_batch()
            inputs, labels = batch[:, :-1], batch[:, 1:]
            optimizers.zero_grad()
            pred = model(inputs)
            loss = nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers.step()
            lr_schedulers.step()
            train_state.ntokens_seen += inputs.numel()
            checkpoint.save(train_state.step, states, force=train_state.step == args.steps)
            if checkpoint.should_stop:
                break


if __name__ == "__main__":
    main()
