"""An iterable dataset (a stream of records) through tg.ResumableIterable, a step counter from restore()."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import trainguard as tg


def records(epoch):
    g = torch.Generator().manual_seed(epoch)
    for _ in range(200):
        yield torch.randn(6, generator=g)


def trainguard_state(root="ckpts/iterable"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 24), nn.SiLU(), nn.Linear(24, 6))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    stream = tg.ResumableIterable(records, batch_size=10)
    state = {"model": model, "optim": opt, "sched": sched, "stream": stream, "rng": tg.RNGState(),
             "progress": tg.StateDict(step=0)}
    return state, {"root": root, "save": tg.EveryNSteps(7), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=45)
    args = ap.parse_args()
    state, settings = trainguard_state()
    model, opt, sched, stream = state["model"], state["optim"], state["sched"], state["stream"]
    loader = DataLoader(stream, batch_size=10, num_workers=0, generator=torch.Generator())
    with tg.CheckpointManager(**settings) as mgr:
        step = mgr.restore(state) or 0
        while step < args.steps:
            for x in loader:
                noisy = x + 0.1 * torch.randn_like(x)
                loss = nn.functional.mse_loss(model(noisy), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                stream.advance(len(x))
                step += 1
                state["progress"]["step"] = step
                mgr.save(step, state)
                if step == args.steps:
                    break
            else:
                stream.next_epoch()


if __name__ == "__main__":
    main()
