"""A 2-rank DDP training recipe for tests/test_hunt47_recipes.py, launched by ``trainguard run``:
``recipe47_ddp.py OUT_DIR OPTS_JSON``; the run directory is ``TRAINGUARD_RUN_DIR``.

DDP over gloo, bf16 autocast + ``GradScaler("cpu")``, gradient accumulation over 2 micro-batches
(``no_sync`` on the first), clipping, AdamW with two parameter groups, warm-up then cosine, an EMA,
dropout, 2 persistent DataLoader workers per rank over ``tg.ResumableSampler`` +
``tg.SeededDataset`` with NumPy and Python ``random`` augmentation, async saves, several epochs.
Each rank appends one JSON line per completed step to ``OUT_DIR/log-RANK`` (loss bits, indices);
rank 0 writes the final state to ``OUT_DIR/final.pt``. ``opts["term_agent_at"]``: rank 0 sends SIGTERM to
``trainguard run``'s agent after that step (a preemption); the loop stops at ``mgr.should_stop`` and exits
with ``mgr.exit_code``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import struct
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from recipe47 import Aug  # the single-process recipe's dataset (this script's directory is on sys.path)


def main() -> None:
    out, opts = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps = opts.get("steps", 16)
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    model = DDP(net)
    decay = [p for p in net.parameters() if p.ndim >= 2]
    rest = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ds = tg.SeededDataset(Aug(opts.get("n", 36)), seed=3)
    sampler = tg.ResumableSampler(len(ds), seed=1, shuffle=True, with_epoch=True)
    workers = opts.get("workers", 2)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=workers,
                                         persistent_workers=workers > 0, generator=torch.Generator(),
                                         worker_init_fn=tg.ignore_stop_signals if workers else None)
    progress = tg.StateDict(step=-1)
    state = {"model": model, "ema": ema, "optim": opt, "sched": sched, "scaler": scaler,
             "data": sampler, "rng": tg.RNGState(), "progress": progress}
    mgr = tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(opts.get("every", 5)),
                               keep=tg.KeepLatest(2), async_save=opts.get("async", True))
    with mgr, open(os.path.join(out, f"log-{rank}"), "a") as logf:
        start = mgr.restore(state)
        step = -1 if start is None else start
        micro = 0
        while step + 1 < steps:
            for x, y, idx in loader:
                micro += 1
                sync = micro % 2 == 0
                with contextlib.nullcontext() if sync else model.no_sync():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = nn.functional.mse_loss(model(x), y) / 2
                    scaler.scale(loss).backward()
                sampler.advance(len(idx))
                if not sync:
                    continue
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                sched.step()
                ema.update_parameters(net)
                step += 1
                progress["step"] = step
                bits = struct.unpack("<I", struct.pack("<f", float(loss.detach())))[0]
                logf.write(json.dumps({"step": step, "loss": bits, "idx": idx.tolist(), "epoch": sampler.epoch,
                                       "lr": opt.param_groups[0]["lr"], "scale": scaler.get_scale()}) + "\n")
                logf.flush()
                if rank == 0 and step == opts.get("term_agent_at"):  # a preemption: SIGTERM to the agent
                    os.kill(int(os.environ["TRAINGUARD_AGENT_PID"]), signal.SIGTERM)
                    # until the agent's SIGTERM reached this rank (bounded): under load the ranks ran to the
                    # last step before it came, and the test's "saved before step 19" failed (slow set, once)
                    mgr._preempt.wait(60)
                mgr.save(step, state)
                if step + 1 >= steps or mgr.should_stop:  # a stop signal: saved at this step
                    break
            else:
                sampler.next_epoch()
                continue
            if mgr.should_stop:
                break
        mgr.wait()
    if mgr.should_stop:
        dist.destroy_process_group()
        sys.exit(mgr.exit_code)  # 143 after a SIGTERM's save: a requeue wrapper starts the job again
    if rank == 0:
        final = {f"model.{k}": v for k, v in net.state_dict().items()}
        final.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
        final["optim"] = opt.state_dict()
        final["sched"] = {k: v for k, v in sched.state_dict().items() if k != "_schedulers"}
        final["scaler"] = scaler.state_dict()
        final["data"] = sampler.state_dict()
        torch.save(final, os.path.join(out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
