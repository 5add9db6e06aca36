"""An EMA of the weights (torch.optim.swa_utils.AveragedModel), evaluated every few steps."""
import argparse

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import trainguard as tg


def trainguard_state(root="ckpts/ema"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[30, 60], gamma=0.3)
    state = {"model": model, "ema": ema_model, "optim": opt, "sched": sched, "rng": tg.RNGState(),
             "progress": tg.StateDict(step=-1, best=float("inf"))}
    return state, {"root": root, "save": tg.EveryNSteps(10), "keep": tg.KeepLatest(2) | tg.KeepBest("val")}


@torch.no_grad()
def evaluate(net):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(256, 4, generator=g)
    return nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    state, settings = trainguard_state()
    model, ema_model, opt, sched = state["model"], state["ema"], state["optim"], state["sched"]
    progress = state["progress"]
    with tg.CheckpointManager(**settings) as mgr:
        mgr.restore(state)
        for step in range(progress["step"] + 1, args.steps):
            x = torch.randn(32, 4)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ema_model.update_parameters(model)
            progress["step"] = step
            metrics = None
            if step % 10 == 9:
                val = evaluate(ema_model)
                progress["best"] = min(progress["best"], val)
                metrics = {"val": val}
            mgr.save(step, state, metrics=metrics)


if __name__ == "__main__":
    main()
