"""A demanding single-process training recipe for tests/test_hunt47_recipes.py, run as a script:
``python recipe47.py RUN_DIR LOG OUT OPTS_JSON``.

fp16 (or bf16) autocast on the CPU with ``GradScaler("cpu")`` (small initial scale, so steps are
skipped), gradient accumulation over 2 micro-batches saved by completed optimizer steps, clipping
after ``unscale_``, two parameter groups (lr, weight decay), a backbone frozen until step
``unfreeze`` then trained, warm-up then cosine (``SequentialLR``), ``ReduceLROnPlateau`` on a second
optimizer (a critic) stepped each epoch, an EMA (``AveragedModel``), dropout, a DataLoader with 2
persistent workers over ``tg.ResumableSampler(shuffle, with_epoch)`` + ``tg.SeededDataset`` whose
``__getitem__`` draws NumPy and Python ``random`` augmentation, ``drop_last=True``, several epochs.

Each completed step appends one JSON line to LOG: step, loss bits, batch indices, lr. At the end
the final state goes to OUT with ``torch.save``. ``opts["kill_at"]`` SIGKILLs the process after that
step's optimizer step, before its save call (between saves).
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import sys

import numpy as np
import torch
from torch import nn

import trainguard as tg


class Aug(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):  # augmentation drawn in the worker: NumPy and Python random
        x = self.x[i] * float(np.random.uniform(0.9, 1.1)) + 0.01 * random.random()
        return x, self.y[i], i


def bits(t: torch.Tensor) -> int:
    return struct.unpack("<I", struct.pack("<f", float(t)))[0]


def main() -> None:
    root, log, out, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    steps = opts.get("steps", 24)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 1))
    model = nn.Sequential(backbone, head)
    critic = nn.Linear(8, 1)
    unfreeze = opts.get("unfreeze", 6)
    for p in backbone.parameters():
        p.requires_grad_(False)
    addgroup = opts.get("addgroup", False)  # the backbone joins the optimizer at `unfreeze`
    groups = [{"params": head.parameters(), "lr": 3e-3, "weight_decay": 0.0}]
    backbone_group = {"params": list(backbone.parameters()), "lr": 1e-3, "weight_decay": 0.1}
    if not addgroup:
        groups.insert(0, backbone_group)
    opt = torch.optim.AdamW(groups)
    if opts.get("onecycle"):
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in groups], total_steps=steps)
    else:
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])
    copt = torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(copt, patience=0, factor=0.5)
    dtype = getattr(torch, opts.get("amp_dtype", "float16"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ds = tg.SeededDataset(Aug(opts.get("n", 22)), seed=3)
    sampler = tg.ResumableSampler(len(ds), seed=1, shuffle=True, with_epoch=True)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=opts.get("workers", 2),
        persistent_workers=opts.get("workers", 2) > 0, drop_last=True, generator=torch.Generator())
    progress = tg.StateDict(step=-1, epoch_loss=0.0)
    state = {"model": model, "critic": critic, "ema": ema, "optim": opt, "copt": copt,
             "sched": sched, "plateau": plateau, "scaler": scaler, "data": sampler,
             "rng": tg.RNGState(), "progress": progress}
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(opts.get("every", 5)), keep=tg.KeepLatest(2),
                               async_save=opts.get("async", True), ram_tier=opts.get("ram", None))
    with mgr, open(log, "a") as logf:
        if addgroup and (mgr.latest_step() or -1) >= unfreeze - 1:  # docs/checkpoints.md, Loading
            opt.add_param_group(dict(backbone_group))
        start = mgr.restore(state)
        step = -1 if start is None else start
        if step + 1 >= unfreeze:
            for p in backbone.parameters():
                p.requires_grad_(True)
        micro = 0
        while step + 1 < steps:
            for x, y, idx in loader:
                with torch.autocast("cpu", dtype=dtype):
                    loss = nn.functional.mse_loss(model(x), y) / 2
                scaler.scale(loss).backward()
                closs = (critic(x) - y).square().mean()
                closs.backward()
                progress["epoch_loss"] += float(closs.detach())
                sampler.advance(len(idx))
                micro += 1
                if micro % 2:
                    continue
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                copt.step()
                copt.zero_grad()
                opt.zero_grad()
                sched.step()
                ema.update_parameters(model)
                step += 1
                progress["step"] = step
                if step + 1 == unfreeze:
                    for p in backbone.parameters():
                        p.requires_grad_(True)
                    if addgroup:
                        opt.add_param_group(dict(backbone_group))
                logf.write(json.dumps({"step": step, "loss": bits(loss), "idx": idx.tolist(),
                                       "epoch": sampler.epoch, "lr": [g["lr"] for g in opt.param_groups],
                                       "clr": copt.param_groups[0]["lr"], "scale": scaler.get_scale()}) + "\n")
                logf.flush()
                if step == opts.get("kill_at"):
                    os.kill(os.getpid(), signal.SIGKILL)
                mgr.save(step, state)
                if step + 1 >= steps:
                    break
            else:
                plateau.step(progress["epoch_loss"])
                progress["epoch_loss"] = 0.0  # the epoch's running loss lives in the state
                sampler.next_epoch()
        mgr.wait()
    final = {}
    for name in ("model", "critic", "ema"):
        final.update({f"{name}.{k}": v for k, v in state[name].state_dict().items()})
    final["optim"] = opt.state_dict()
    final["copt"] = copt.state_dict()
    final["sched"] = {k: v for k, v in sched.state_dict().items() if k != "_schedulers"}
    final["plateau"] = plateau.state_dict()
    final["scaler"] = scaler.state_dict()
    final["data"] = sampler.state_dict()
    final["rng"] = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    torch.save(final, out)


if __name__ == "__main__":
    main()
