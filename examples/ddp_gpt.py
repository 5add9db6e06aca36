"""A small GPT trained with DDP the way a real loop is written: DataLoader worker processes over a
``ResumableSampler``, gradient accumulation, bfloat16 autocast, gradient clipping, AdamW with a
warmup + cosine schedule, an evaluation pass every few steps, a metrics log, async saves. Under
``trainguard run`` a rank killed mid-run comes back from the newest checkpoint, and the loss curve
goes on bit-identically; the job may come back at another world size and the data goes on at the
same sample (the global batch stays the same: each rank takes ``global_batch / world / accum``).

    trainguard run --nproc-per-node 2 --run-dir runs/gpt examples/ddp_gpt.py --steps 40
    trainguard run --nproc-per-node 2 --run-dir runs/gpt --fault step=23,rank=1,kind=kill examples/ddp_gpt.py
    trainguard run --nproc-per-node 1 --run-dir runs/gpt examples/ddp_gpt.py --steps 60   # resumes on 1 rank
    trainguard doctor examples/ddp_gpt.py
    trainguard inspect runs/gpt/step-000000039          # the sampler's epoch and position among the entries

Fast restarts: add ``--start-method fork --run-path`` (the workers are forked from the agent, which
imported torch once: a restart took 0.3-0.6 s here, 4-11 s with new interpreters on a loaded machine).

``metrics.jsonl`` (rank 0) gets one line per optimizer step and per evaluation. After a resume the
steps between the restored checkpoint and the failure are logged again: keep each step's last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import trainguard as tg

VOCAB, CTX = 64, 32


class Tokens(Dataset):
    """Synthetic token sequences; a sample is ``(index, tokens)`` so the log can show which were read."""

    def __init__(self, n: int, seed: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, CTX + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.data[i]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(CTX, d)
        nn.init.normal_(self.wte.weight, std=0.02)
        self.drop = nn.Dropout(p)  # dropout draws from the torch RNG: tg.RNGState() saves it per rank
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: saved once, loaded as a tie

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1))))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


TRAIN = Tokens(512, seed=1)


def trainguard_state(root: str = "runs/gpt", ddp: bool = False, save_every: int = 5,
                     total_steps: int = 40) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings: main() trains with them (``ddp=True``, in its
    process group), ``trainguard doctor`` checks them (outside any)."""
    torch.manual_seed(0)  # the same initial weights on every rank, and before the restore, which puts the RNG back
    net = GPT()
    model = DDP(net) if ddp else net
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    # A function is not saved (your code builds it again), a functools.partial's arguments neither:
    # the schedule's position is the scheduler's last_epoch, which is.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_cosine, warmup=5, total=total_steps))
    sampler = tg.ResumableSampler(TRAIN, seed=0)  # was: DistributedSampler(TRAIN, shuffle=True, seed=0)
    state = {"model": model, "optim": opt, "sched": sched, "rng": tg.RNGState(), "data": sampler,
             "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(save_every), "keep": tg.KeepLatest(3), "async_save": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=os.environ.get("TRAINGUARD_RUN_DIR", "runs/gpt"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % (world * args.accum):  # exit 78: trainguard run does not restart a job that cannot fit
        print(f"global batch {args.global_batch} needs world size x accum dividing it, not {world} x {args.accum}",
              file=sys.stderr)
        sys.exit(78)
    micro = args.global_batch // world // args.accum
    state, settings = trainguard_state(args.run_dir, ddp=True, save_every=args.save_every, total_steps=args.steps)
    model, opt, sched, sampler = state["model"], state["optim"], state["sched"], state["data"]
    loader = DataLoader(TRAIN, batch_size=micro, sampler=sampler, num_workers=args.workers,
                        generator=torch.Generator(),              # the global RNG stays the training step's
                        worker_init_fn=tg.ignore_stop_signals)    # a SIGTERM to the whole group spares them
    val_loader = DataLoader(Tokens(64, seed=2), batch_size=16)    # no randomness; passes resume as they are
    log = open(os.path.join(args.run_dir, "metrics.jsonl"), "a") if rank == 0 else None

    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        step = -1 if start is None else start
        if rank == 0:
            print("fresh start" if start is None else f"resumed from step {start} at world size {world}", flush=True)
        while step + 1 < args.steps and not mgr.should_stop:
            sampler.set_epoch(sampler.epoch)  # the restored epoch: its position is kept
            batches = iter(loader)
            while step + 1 < args.steps:
                window = [b for _, b in zip(range(args.accum), batches)]
                if len(window) < args.accum:  # the epoch's end (512 samples make whole windows here)
                    break
                model.train()
                loss_sum, seen = 0.0, []
                for k, (idx, xy) in enumerate(window):
                    sync = k == args.accum - 1  # DDP all-reduces the gradients of the window's last micro-batch
                    with (torch.enable_grad() if sync else model.no_sync()), torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(xy[:, :-1])
                        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), xy[:, 1:].reshape(-1)) / args.accum
                    loss.backward()
                    loss_sum += loss.item()
                    seen += idx.tolist()
                    sampler.advance(len(idx))  # what this rank read, per micro-batch
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                every = [None] * world
                dist.all_gather_object(every, seen)
                if log:
                    log.write(json.dumps({"step": step, "loss": loss_sum, "lr": sched.get_last_lr()[0], "world": world,
                                          "epoch": sampler.epoch, "samples": every}) + "\n")
                    log.flush()
                if (step + 1) % args.eval_every == 0:
                    model.eval()
                    with torch.no_grad():
                        val = sum(F.cross_entropy(model(xy[:, :-1]).reshape(-1, VOCAB), xy[:, 1:].reshape(-1)).item()
                                  for _, xy in val_loader) / len(val_loader)
                    model.train()
                    if log:
                        log.write(json.dumps({"step": step, "val_loss": val}) + "\n")
                        log.flush()
                state["progress"]["step"] = step
                mgr.save(step, state, force=step == args.steps - 1)  # once per optimizer step, after it
                if mgr.should_stop:  # SIGTERM on any rank: every rank saved this step
                    break
            if not mgr.should_stop and step + 1 < args.steps:  # the epoch ended
                sampler.next_epoch()
    if rank == 0:  # after close(): the last async save collected (inside the block it still names the one before)
        print(f"{'stopped' if mgr.should_stop else 'done'} at step {step}, saved step {mgr.last_saved_step}", flush=True)
    dist.destroy_process_group()
    sys.exit(mgr.exit_code)  # 143 after a preemption save, for a requeue wrapper


if __name__ == "__main__":
    main()
