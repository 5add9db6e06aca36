"""A plain PyTorch training loop with trainguard: save every few steps, resume after a restart.

    python examples/plain_loop.py --dir ckpts/plain --steps 20
    python examples/plain_loop.py --dir ckpts/plain --steps 40   # resumes where the first run stopped
    trainguard doctor examples/plain_loop.py   # checks what trainguard_state() returns

The batches are drawn from torch's RNG, which ``tg.RNGState()`` saves: that is this loop's data
position (the doctor's "data position" warning asks for a sampler; a real loop adds one).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

import trainguard as tg


def trainguard_state(root: str = "ckpts/plain") -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings: main() trains with them, and
    ``trainguard doctor`` calls this to check them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    state = {"model": model, "optim": opt, "sched": sched, "rng": tg.RNGState(), "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(5), "keep": tg.KeepLatest(2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpts/plain")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    state, settings = trainguard_state(args.dir)
    model, opt, sched = state["model"], state["optim"], state["sched"]
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        print("fresh start" if start is None else f"resumed from step {start}")
        first = 0 if start is None else start + 1
        for step in range(first, args.steps):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state["progress"]["step"] = step
            mgr.save(step, state, force=step == args.steps - 1)
            if mgr.should_stop:  # SIGTERM/SIGINT (a preemption): this step was just saved; exit now
                break
        print(f"{'stopped' if mgr.should_stop else 'done'} at step {state['progress']['step']}, saved step {mgr.last_saved_step}")
    sys.exit(mgr.exit_code)  # 143 after a SIGTERM: a requeue wrapper resumes the run (docs/elastic.md, exit codes)


if __name__ == "__main__":
    main()
