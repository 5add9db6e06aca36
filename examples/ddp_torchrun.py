"""DistributedDataParallel under torchrun: every rank calls the manager in the same order; the
replicated weights and optimizer state are written once in total, spread over the ranks (each
writes about 1/N of their bytes), and each rank writes its own RNG state.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --dir ckpts/ddp --steps 10
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --dir ckpts/ddp --steps 20   # resumes
    trainguard doctor examples/ddp_torchrun.py   # checks what trainguard_state() returns

The batches are drawn from each rank's torch RNG, which ``tg.RNGState()`` saves per rank: that is
this loop's data position (the doctor's "data position" warning asks for a sampler; a real loop
adds ``tg.ResumableSampler``). The learning rate is constant: the doctor's warning of an optimizer
saved without a scheduler does not apply.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg


def trainguard_state(root: str = "ckpts/ddp", ddp: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings. main() calls it with ``ddp=True`` in its
    process group; ``trainguard doctor`` without, outside any: the checkpoint is the same, as
    trainguard saves a DDP module as the module it wraps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    model = DDP(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    state = {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(4), "keep": tg.KeepLatest(2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpts/ddp")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()
    state, settings = trainguard_state(args.dir, ddp=True)
    model, opt = state["model"], state["optim"]

    torch.manual_seed(1000 + rank)  # each rank its own data; before restore, which puts the saved RNG back
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        if rank == 0:
            print("fresh start" if start is None else f"resumed from step {start}", flush=True)
        for step in range(0 if start is None else start + 1, args.steps):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["progress"]["step"] = step
            mgr.save(step, state, force=step == args.steps - 1)
            if mgr.should_stop:  # SIGTERM/SIGINT on any rank (a preemption): every rank saved this step; exit now
                break
        if rank == 0:
            print(f"{'stopped' if mgr.should_stop else 'done'} at step {state['progress']['step']}, "
                  f"saved step {mgr.last_saved_step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
