"""Epochs with early stopping: a patience counter (bad_epochs) and the best loss saved with the rest."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
TRAIN = TensorDataset(torch.randn(96, 5, generator=G), torch.randn(96, 1, generator=G))
VAL = TensorDataset(torch.randn(32, 5, generator=G), torch.randn(32, 1, generator=G))


def trainguard_state(root="ckpts/early"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 20), nn.ReLU(), nn.Dropout(0.2), nn.Linear(20, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)
    sampler = tg.ResumableSampler(TRAIN, seed=0)
    state = {"model": model, "optimizer": optimizer, "plateau": plateau, "sampler": sampler,
             "rng": tg.RNGState(), "stopping": tg.StateDict(best_val=float("inf"), bad_epochs=0)}
    return state, {"root": root, "save": tg.EveryNSteps(1), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max_epochs", type=int, default=20)
    ap.add_argument("--patience", type=int, default=3)
    args = ap.parse_args()
    state, settings = trainguard_state()
    model, optimizer, plateau, sampler = state["model"], state["optimizer"], state["plateau"], state["sampler"]
    stopping = state["stopping"]
    train_loader = DataLoader(TRAIN, batch_size=12, sampler=sampler, generator=torch.Generator())
    val_loader = DataLoader(VAL, batch_size=32)
    with tg.CheckpointManager(**settings) as mgr:
        mgr.restore(state)
        while sampler.epoch < args.max_epochs and stopping["bad_epochs"] < args.patience:
            model.train()
            for x, y in train_loader:
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sampler.advance(len(x))
            model.eval()
            with torch.no_grad():
                val = sum(nn.functional.mse_loss(model(x), y, reduction="sum").item() for x, y in val_loader) / len(VAL)
            plateau.step(val)
            if val < stopping["best_val"]:
                stopping["best_val"], stopping["bad_epochs"] = val, 0
            else:
                stopping["bad_epochs"] += 1
            sampler.next_epoch()
            mgr.save(sampler.epoch, state)


if __name__ == "__main__":
    main()
