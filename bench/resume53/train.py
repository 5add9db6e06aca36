"""The resume audit's training script (hunt53 resume53): a small real loop (MLP with dropout, AdamW or another
optimizer, an LR scheduler, optional bf16 autocast + GradScaler, accumulation, clipping, an EMA model,
DataLoader workers over ResumableSampler + SeededDataset or a ResumableIterable, DDP under trainguard run)
using trainguard as README and docs/data.md show. Driven by one.py, ddp.py and restart.py.

    python train.py CONFIG_JSON

Keys: out, steps, accum, bs, n, sched, opt, amp, init_scale, clip, workers, persistent, iterable, dropout, bn,
loop_rng, own_rng, ema ("copy"/"swa"), edit_after_save, save_mid_accum, async, bg, wait_staged, save_every,
crash_step, crash_rank, preempt_step, ddp, attempt, no_gen. Writes <out>/losses-r<rank>.jsonl (a line per
optimizer step, every attempt), <out>/seen-r<rank>.jsonl (the sample indices of each micro-batch) and at the
end <out>/final-r<rank>.pt (model, optimizer, scheduler, scaler, EMA state dicts, RNG states, data position).
"""
import json
import math
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg

cfg = json.loads(sys.argv[1])
out = cfg["out"]
os.makedirs(out, exist_ok=True)
steps = cfg.get("steps", 40)
accum = cfg.get("accum", 1)
bs = cfg.get("bs", 4)
N = cfg.get("n", 48)
torch.manual_seed(0)
np.random.seed(0)
random.seed(0)
torch.set_num_threads(1)

dist = cfg.get("ddp", False)
if dist:
    torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank() if dist else 0
world = torch.distributed.get_world_size() if dist else 1


class Aug(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randn(N, 4, generator=g)
        self.rng, self.pyrng, self.tg = np.random.default_rng(0), random.Random(1), torch.Generator().manual_seed(2)

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.x[i]
        if cfg.get("own_rng"):
            x = x + float(self.rng.random()) + self.pyrng.random() + float(torch.rand(1, generator=self.tg))
        if cfg.get("augment", True):
            x = x + 0.1 * torch.randn(8) + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return x, self.y[i], torch.tensor(i)


model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(cfg.get("dropout", 0.2)),
                            torch.nn.Linear(32, 4))
if cfg.get("bn"):
    model.insert(1, torch.nn.BatchNorm1d(32))
ddp_model = torch.nn.parallel.DistributedDataParallel(model) if dist else model
ok = cfg.get("opt", "adamw")
decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
nodecay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
groups = [{"params": decay, "weight_decay": 0.01}, {"params": nodecay, "weight_decay": 0.0}]
lr0 = cfg.get("lr", 1e-2)
if ok == "lbfgs":
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, history_size=4, max_iter=3)
elif ok == "sgd":
    opt = torch.optim.SGD(groups, lr=lr0, momentum=0.9, nesterov=True)
elif ok == "adamw":
    opt = torch.optim.AdamW(groups, lr=lr0)
else:
    kw = {"lr": lr0}
    opt = getattr(torch.optim, ok)(model.parameters(), **kw)

sk = cfg.get("sched", "step")
if sk == "onecycle":
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps + 5)
elif sk == "sequential":
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=7),
                                                       torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)],
                                                  milestones=[7])
elif sk == "chained":
    sched = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.ExponentialLR(opt, 0.97),
                                                       torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)])
elif sk == "plateau":
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=1e-3)
elif sk == "lambda":
    warm = cfg.get("warm", 6)

    def lam(s):  # a closure over warm and steps
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
elif sk == "warmrestarts":
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5, T_mult=2)
elif sk == "cyclic":
    sched = torch.optim.lr_scheduler.CyclicLR(opt, 1e-3, 5e-2, step_size_up=4, mode="exp_range", gamma=0.97)
elif sk == "swalr":
    sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.003, anneal_epochs=6, anneal_strategy="cos")
elif sk == "poly":
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=20, power=2.0)
elif sk == "multistep":
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [5, 12, 12, 18], 0.5)
else:
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)

amp = cfg.get("amp", False)
scaler = torch.amp.GradScaler("cpu", init_scale=cfg.get("init_scale", 2.0 ** 16), growth_interval=3) if amp else None

ema = None
if cfg.get("ema"):
    if cfg["ema"] == "swa":
        ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    else:
        import copy
        ema = copy.deepcopy(model)
        for p in ema.parameters():
            p.requires_grad_(False)

workers = cfg.get("workers", 0)
if cfg.get("iterable"):
    def records(epoch):
        return iter(range(N))

    base = Aug()

    def transform(i):
        x, y, idx = base[i]
        return x, y, idx
    data = tg.ResumableIterable(records, batch_size=bs, transform=transform, seed=7)
    loader = DataLoader(data, batch_size=bs, num_workers=workers, generator=torch.Generator())
    sampler = data
else:
    sampler = tg.ResumableSampler(N, seed=5, with_epoch=True, shuffle=True, drop_last=cfg.get("drop_last", False))
    kw = dict(num_workers=workers, generator=None if cfg.get("no_gen") else torch.Generator())
    if workers:
        kw.update(persistent_workers=cfg.get("persistent", False), worker_init_fn=tg.ignore_stop_signals)
    loader = DataLoader(tg.SeededDataset(Aug(), seed=9), batch_size=bs, sampler=sampler, **kw)

state = {"model": ddp_model, "optim": opt, "sched": sched, "rng": tg.RNGState(), "data": sampler,
         "progress": tg.StateDict(step=-1, epoch_loss=0.0, epoch_n=0)}
if scaler is not None:
    state["scaler"] = scaler
if ema is not None:
    state["ema"] = ema

crash = cfg.get("crash_step")
attempt_file = os.path.join(out, "attempt")
attempt = int(open(attempt_file).read()) if os.path.exists(attempt_file) else 0
attempt = cfg.get("attempt", attempt)
if rank == 0:
    with open(attempt_file, "w") as f:
        f.write(str(attempt + 1))
run_dir = os.environ.get("TRAINGUARD_RUN_DIR", os.path.join(out, "ckpt"))
seen = open(os.path.join(out, f"seen-r{rank}.jsonl"), "a")
log = open(os.path.join(out, f"losses-r{rank}.jsonl"), "a")
mgr = tg.CheckpointManager(run_dir, save=tg.EveryNSteps(cfg.get("save_every", 5)), keep=tg.KeepLatest(3),
                           async_save=cfg.get("async", False), stage_in_background=cfg.get("bg", False), handle_signals=bool(cfg.get("preempt_step")))
with mgr:
    start = mgr.restore(state)
    step = -1 if start is None else start
    epochs = 100
    done = False
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch) if hasattr(sampler, "set_epoch") else None
        model.train()
        batches = iter(loader)
        while window := [b for _, b in zip(range(accum), batches)]:
            tot = 0.0
            for mi, (x, y, idx) in enumerate(window):
                seen.write(json.dumps([attempt, sampler.epoch, step + 1, idx.tolist()]) + "\n")
                seen.flush()
                if cfg.get("loop_rng"):
                    x = x * (1 + 0.01 * float(np.random.randn())) + random.gauss(0, 0.01)
                ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
                sync = ddp_model.no_sync() if (dist and mi < len(window) - 1) else torch.autocast("cpu", enabled=False)
                with sync:
                    with ctx:
                        loss = torch.nn.functional.mse_loss(ddp_model(x).float(), y) / len(window)
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                tot += loss.item()
                sampler.advance(len(x))
                if cfg.get("preempt_step") == step + 1 and attempt == 0 and mi == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                if cfg.get("save_mid_accum") and mi == 0 and len(window) > 1:
                    # a save after the first micro-batch (what the docs warn against)
                    mgr.save(step + 1, state, force=True)
            if scaler is not None:
                scaler.unscale_(opt)
            if cfg.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif ok == "lbfgs":
                def closure(ctx=ctx, window=window):
                    opt.zero_grad()
                    with ctx:
                        l2 = sum(torch.nn.functional.mse_loss(ddp_model(x2).float(), y2) for x2, y2, _ in window)
                    l2.backward()
                    return l2
                opt.step(closure)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if sk == "plateau":
                state["progress"]["epoch_loss"] += tot
                state["progress"]["epoch_n"] += 1
                sched.step(state["progress"]["epoch_loss"] / state["progress"]["epoch_n"])
            else:
                sched.step()
            step += 1
            state["progress"]["step"] = step
            log.write(json.dumps([step, tot.hex(), opt.param_groups[0]["lr"]]) + "\n")
            log.flush()
            if ema is not None and cfg.get("ema_before", True):
                with torch.no_grad():
                    if cfg["ema"] == "swa":
                        ema.update_parameters(model)
                    else:
                        for pe, pm in zip(ema.parameters(), model.parameters()):
                            pe.lerp_(pm, 0.1)
            h = mgr.save(step, state)
            if h is not None and cfg.get("wait_staged"):
                h.wait_staged()
            if ema is not None and not cfg.get("ema_before", True):
                with torch.no_grad():
                    if cfg["ema"] == "swa":
                        ema.update_parameters(model)
                    else:
                        for pe, pm in zip(ema.parameters(), model.parameters()):
                            pe.lerp_(pm, 0.1)
            if cfg.get("edit_after_save"):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.999)
            if mgr.should_stop:
                break
            if crash is not None and attempt == 0 and step == crash and rank == cfg.get("crash_rank", 0):
                os.kill(os.getpid(), signal.SIGKILL)
            if step + 1 >= steps:
                done = True
                break
        if done or mgr.should_stop:
            break
        if sk == "plateau":
            state["progress"]["epoch_loss"] = 0.0
            state["progress"]["epoch_n"] = 0
        sampler.next_epoch()
    mgr.wait()
fin = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": {k: v for k, v in sched.state_dict().items()
                                                                         if not callable(v)},
       "torch_rng": torch.get_rng_state(), "np": np.random.get_state()[1].tolist(), "py": random.getstate()[1],
       "data": sampler.state_dict()}
if scaler is not None:
    fin["scaler"] = scaler.state_dict()
if ema is not None:
    fin["ema"] = ema.state_dict()
if mgr.exit_code:
    sys.exit(mgr.exit_code)
torch.save(fin, os.path.join(out, f"final-r{rank}.pt"))
if dist:
    torch.distributed.destroy_process_group()
