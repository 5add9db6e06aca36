"""FSDP2 (``fully_shard``) under torchrun: parameters and Adam state are DTensors; each rank
writes only its shards, and a restore reads only the byte ranges each rank holds (also at a
different world size). A resume is bit-identical to a run that never stopped: every rank's RNG
is saved (``tg.RNGState()``) and its data seed is set before ``restore``, which puts the saved
RNG back.

    torchrun --nproc-per-node 2 examples/fsdp2.py --dir ckpts/fsdp2 --steps 6
    torchrun --nproc-per-node 2 examples/fsdp2.py --dir ckpts/fsdp2 --steps 9   # resumes
    trainguard doctor examples/fsdp2.py   # checks what trainguard_state() returns

The batches are drawn from each rank's torch RNG: that is this loop's data position (the doctor's
"data position" warning asks for a sampler; a real loop adds ``tg.ResumableSampler``). The
learning rate is constant: the doctor's warning of an optimizer saved without a scheduler does not
apply.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard as tg


def build(shard: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded with FSDP2 over the default process group unless ``shard=False``, and Adam."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
    if shard:  # on a CPU mesh, like the gloo group; without one fully_shard takes the accelerator's
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # on GPUs: "cuda", with "nccl"
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def trainguard_state(root: str = "ckpts/fsdp2", shard: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings. main() calls it with ``shard=True`` in its
    process group; ``trainguard doctor`` without, outside any (the same entries, unsharded)."""
    model, opt = build(shard)
    state = {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(3)}


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

    state, settings = trainguard_state(args.dir, shard=True)
    model, opt = state["model"], state["optim"]
    torch.manual_seed(1000 + rank)  # each rank its own data; before restore, which puts the saved RNG back
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        if rank == 0:
            print("fresh start" if start is None else f"resumed from step {start}", flush=True)
        for step in range(0 if start is None else start + 1, args.steps):
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["progress"]["step"] = step
            mgr.save(step, state, force=step == args.steps - 1)
            if mgr.should_stop:  # SIGTERM/SIGINT on any rank (a preemption): every rank saved this step; exit now
                break
        mgr.wait()
        # What a restarted job would do: fresh sharded model + optimizer, restore, compare.
        state2, _ = trainguard_state(args.dir, shard=True)
        model2, opt2 = state2["model"], state2["optim"]
        restored = mgr.restore(state2)
        same = all(torch.equal(a, b) for a, b in zip(full(model, opt), full(model2, opt2)))
    if rank == 0:
        print(f"restored step {restored} on {dist.get_world_size()} ranks: state equal = {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
