"""Mixed precision: float16 autocast with a GradScaler, a step loop with a walrus restore."""
import argparse

import torch
from torch import nn

import trainguard as tg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def trainguard_state(root="ckpts/amp"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    scaler = torch.amp.GradScaler(DEVICE)
    state = {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "rng": tg.RNGState(),
             "step": tg.StateDict(step=0)}
    return state, {"root": root, "save": tg.EveryNSteps(25), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    state, settings = trainguard_state()
    model, opt, sched, scaler = state["model"], state["opt"], state["sched"], state["scaler"]
    with tg.CheckpointManager(**settings) as mgr:
        first = 0
        if (r := mgr.restore(state)) is not None:
            first = r + 1
        for step in range(first, args.steps):
            x = torch.randn(64, 32, device=DEVICE)
            with torch.autocast(device_type=DEVICE, dtype=torch.float16):
                loss = (model(x) - x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            state["step"]["step"] = step
            mgr.save(step, state)
            if mgr.should_stop:
                break


if __name__ == "__main__":
    main()
