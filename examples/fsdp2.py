"""FSDP2 (``fully_shard``) under torchrun: parameters and Adam state are DTensors; each rank
writes only its shards, and a restore reads only the byte ranges each rank holds (also at a
different world size). A resume is bit-identical to a run that never stopped: every rank's RNG
is saved (``tg.RNGState()``) and its data seed is set before ``restore``, which puts the saved
RNG back.

    torchrun --nproc-per-node 2 examples/fsdp2.py --dir ckpts/fsdp2 --steps 6
    torchrun --nproc-per-node 2 examples/fsdp2.py --dir ckpts/fsdp2 --steps 9   # resumes
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import trainguard as tg


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and Adam moment, whole (a collective: every rank calls it)."""
    out = [p.full_tensor() for p in model.parameters()]
    for p in model.parameters():
        out += [v.full_tensor() for k, v in opt.state[p].items() if k != "step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpts/fsdp2")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()

    model, opt = build()
    state = {"model": model, "optim": opt, "rng": tg.RNGState()}
    torch.manual_seed(1000 + rank)  # each rank its own data; before restore, which puts the saved RNG back
    with tg.CheckpointManager(args.dir, save=tg.EveryNSteps(3)) as mgr:
        start = mgr.restore(state)
        if rank == 0:
            print("fresh start" if start is None else f"resumed from step {start}", flush=True)
        for step in range(0 if start is None else start + 1, args.steps):
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save(step, state, force=step == args.steps - 1)
        mgr.wait()
        # What a restarted job would do: fresh sharded model + optimizer, restore, compare.
        model2, opt2 = build()
        restored = mgr.restore({"model": model2, "optim": opt2, "rng": tg.RNGState()})
        same = all(torch.equal(a, b) for a, b in zip(full(model, opt), full(model2, opt2)))
    if rank == 0:
        print(f"restored step {restored} on {dist.get_world_size()} ranks: state equal = {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
