"""Pipeline parallelism (``torch.distributed.pipelining``) under torchrun: rank ``r`` runs stage
``r`` of a 2-stage GPipe schedule. As in torchtitan, each stage builds the whole model (the whole
model's parameter names) and deletes the other stage's layers; the stages hold different tensors,
so they save one checkpoint with ``split_state=True``, which loads into another split of the
stages or into the whole model on one process without the flag (docs/distributed.md, "Pipeline
stages and experts").

    torchrun --nproc-per-node 2 examples/pipeline.py --dir ckpts/pp --steps 10
    torchrun --nproc-per-node 2 examples/pipeline.py --dir ckpts/pp --steps 20   # resumes

Both stages read the same batches (the pipeline is one data-parallel replica): the
``tg.ResumableSampler`` is told it is rank 0 of 1 on both, and both call ``advance``, so its state
is equal on the two ranks (it is saved once, as any object every rank holds). Stage 0 feeds the
inputs, the last stage the targets. Dropout draws from each rank's torch RNG, which
``tg.RNGState()`` saves per rank: a resume is bit-identical to a run that never stopped.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

N_LAYERS = 4
STAGES = 2


class Block(nn.Module):
    """A residual MLP block with dropout (draws from the rank's torch RNG)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


class Net(nn.Module):
    """Input projection, ``N_LAYERS`` blocks, output head. A stage deletes what it does not run;
    ``forward`` skips what is missing (torchtitan's pattern)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(8, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(N_LAYERS)})
        self.out: nn.Module | None = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x) if self.out is not None else x


def build(stage: int | None = None) -> Net:
    """The whole model (same initial weights on every process), cut to pipeline stage ``stage``
    (layers ``stage * N_LAYERS // STAGES`` and up; the input projection on the first stage, the
    head on the last) unless None."""
    torch.manual_seed(0)
    model = Net()
    if stage is not None:
        per = N_LAYERS // STAGES
        for i in range(N_LAYERS):
            if i // per != stage:
                del model.layers[str(i)]
        if stage != 0:
            model.inp = None
        if stage != STAGES - 1:
            model.out = None
    return model


def dataset() -> TensorDataset:
    """32 samples of a fixed regression problem (the same on every rank)."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(32, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def trainguard_state(root: str = "ckpts/pp", stage: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings. main() calls it with its rank as ``stage``
    in its process group; ``trainguard doctor`` without, outside any (the whole model: the same
    entries, every layer)."""
    model = build(stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    sampler = tg.ResumableSampler(dataset(), seed=0, rank=0, world_size=1)  # one replica: both stages read every batch
    state = {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": tg.RNGState(),
             "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(3), "keep": tg.KeepLatest(2), "split_state": stage is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpts/pp")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs (and device=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    assert dist.get_world_size() == STAGES, f"run with --nproc-per-node {STAGES}"
    last = rank == STAGES - 1

    state, settings = trainguard_state(args.dir, stage=rank)
    model, opt, sched, sampler = state["model"], state["optim"], state["sched"], state["data"]
    # generator=: the loader's own seed draw would otherwise come from the global RNG (docs/data.md)
    loader = DataLoader(dataset(), batch_size=8, sampler=sampler, generator=torch.Generator())

    stage = PipelineStage(model, stage_index=rank, num_stages=STAGES, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)

    torch.manual_seed(1000 + rank)  # each stage's dropout; before restore, which puts the saved RNG back
    with tg.CheckpointManager(**settings) as mgr:  # split_state=True: the stages hold different layers
        start = mgr.restore(state)
        if rank == 0:
            print("fresh start" if start is None else f"resumed from step {start}", flush=True)
        step = 0 if start is None else start + 1
        while step < args.steps and not mgr.should_stop:
            for x, y in loader:  # from the sampler's saved position
                opt.zero_grad()
                losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=losses)
                opt.step()
                sched.step()
                sampler.advance(len(x))  # on every rank: the sampler is saved once, equal everywhere
                state["progress"]["step"] = step
                mgr.save(step, state, force=step == args.steps - 1)
                if last and losses:
                    print(f"step {step} loss {torch.stack(losses).mean().item():.6f}", flush=True)
                step += 1
                if step >= args.steps or mgr.should_stop:  # SIGTERM/SIGINT on any rank: every rank saved
                    break
            else:
                sampler.next_epoch()
        if rank == 0:
            print(f"{'stopped' if mgr.should_stop else 'done'} at step {state['progress']['step']}, "
                  f"saved step {mgr.last_saved_step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
