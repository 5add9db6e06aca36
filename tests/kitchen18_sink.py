"""A realistic DDP training loop on gloo ranks (CPU) for tests/test_kitchen18_review.py: BatchNorm,
Dropout, LayerNorm, ``DDP(model)`` defaults, AdamW with two parameter groups, gradient clipping,
gradient accumulation over 2 micro-batches (``no_sync`` on the first), bfloat16 autocast with a
``GradScaler("cpu")``, warm-up then cosine (``SequentialLR``) stepped per iteration, an EMA
(``AveragedModel`` + ``get_ema_multi_avg_fn``) updated every step, a map-style dataset with random
augmentation read through ``tg.SeededDataset`` + ``tg.ResumableSampler`` by 2 DataLoader workers,
and a validation pass every ``val_every`` steps (``model.eval()`` ... ``model.train()``).

``train(rank, world, root, steps, stop_after, opts)`` is run by ``dist_helper.run_ranks``; it
returns what the test compares: losses and sample indices per step, and the final state of every
part, as tensors/plain values.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

import trainguard as tg

N_SAMPLES = 48


class Augmented(torch.utils.data.Dataset):
    """48 samples of 8 features; ``__getitem__`` adds torch and Python random noise (augmentation)
    and returns the index too, so the test sees the data order."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N_SAMPLES, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) + torch.randn(N_SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i] + 0.1 * torch.randn(8) + 0.01 * random.random()
        return x, self.y[i], i


def make_model(opts: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32)]
    if opts.get("bn", True):
        layers.append(nn.BatchNorm1d(32))
    layers.append(nn.ReLU())
    if opts.get("dropout", True):
        layers.append(nn.Dropout(0.2))
    layers += [nn.Linear(32, 32)]
    if opts.get("ln", True):
        layers.append(nn.LayerNorm(32))
    layers += [nn.ReLU(), nn.Linear(32, 1)]
    return nn.Sequential(*layers)


def train(rank: int, world: int, root: str, steps: int, stop_after: int | None, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = make_model(opts)
    model = DDP(net) if world > 1 or opts.get("ddp1", True) else net
    ddp = model
    if opts.get("compile", False):
        model = torch.compile(model)  # torch.compile(DDP(net)): trainguard unwraps both
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])
    amp = opts.get("amp", True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3, enabled=amp)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True) if opts.get("ema", True) else None

    ds = Augmented()
    sampler = tg.ResumableSampler(ds, seed=7, shuffle=True, with_epoch=True)
    loader = torch.utils.data.DataLoader(
        tg.SeededDataset(ds, seed=3), batch_size=3, sampler=sampler, num_workers=opts.get("workers", 2),
        generator=torch.Generator(), worker_init_fn=tg.ignore_stop_signals,
    )
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "scaler": scaler}
    if ema is not None:
        if opts.get("ema_local", False):
            ema.trainguard_rank_local = True  # each rank saves and resumes its own EMA (docs/distributed.md)
        state["ema"] = ema
    state.update({"data": sampler, "rng": tg.RNGState(), "progress": tg.StateDict(step=-1)})

    torch.manual_seed(1000 + rank)  # each rank its own dropout stream; restore puts the saved one back
    val_x = torch.randn(6, 8, generator=torch.Generator().manual_seed(99))
    log: dict[str, Any] = {"loss": {}, "idx": {}, "val": {}, "lr": {}, "saved": [], "mode_at_save": {}}
    accum = opts.get("accum", 2)
    val_every = opts.get("val_every", 3)
    save_every = opts.get("save_every", 5)

    def batches():
        while True:
            yield from loader
            sampler.next_epoch()

    with tg.CheckpointManager(root, save=tg.EveryNSteps(save_every), keep=tg.KeepLatest(3),
                              async_save=opts.get("async", True)) as mgr:
        start = mgr.restore(state)
        log["start"] = start
        step = 0 if start is None else start + 1
        it = batches()
        while step < steps:
            if stop_after is not None and step > stop_after:
                break
            opt.zero_grad(set_to_none=True)
            total, idx = 0.0, []
            for micro in range(accum):
                x, y, i = next(it)
                ctx = ddp.no_sync() if (micro < accum - 1 and isinstance(ddp, DDP)) else _null()
                with ctx:
                    with torch.autocast("cpu", dtype=getattr(torch, opts.get("dtype", "bfloat16")), enabled=amp):
                        out = model(x)
                        loss = nn.functional.mse_loss(out.float(), y) / accum
                    scaler.scale(loss).backward()
                total += loss.item()
                idx += i.tolist()
                sampler.advance(len(x))
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if ema is not None:
                ema.update_parameters(net)
            if val_every and step % val_every == 0:
                model.eval()
                with torch.no_grad():
                    v = model(val_x).square().mean()
                log["val"][step] = v.item()
                if not opts.get("no_train_after_val", False):
                    model.train()
            log["loss"][step], log["idx"][step], log["lr"][step] = total, idx, sched.get_last_lr()
            state["progress"]["step"] = step
            h = mgr.save(step, state)
            if h is not None:
                log["saved"].append(step)
                log["mode_at_save"][step] = net.training
            if opts.get("no_train_after_val", False):
                model.train()
            step += 1
    final = {
        "model": {k: v.clone() for k, v in net.state_dict().items()},
        "optim": {(gi, k): (v.clone() if torch.is_tensor(v) else v)
                  for gi, s in enumerate(opt.state.values()) for k, v in s.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "sched": _plain(sched.state_dict()),
        "scaler": scaler.state_dict(),
        "ema": {k: v.clone() for k, v in ema.state_dict().items()} if ema is not None else None,
        "sampler": sampler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    return {"log": log, "final": final}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _plain(sd: dict[str, Any]) -> Any:
    out = {}
    for k, v in sd.items():
        if k == "_schedulers":
            out[k] = [_plain(s) for s in v]
        elif callable(v) or k in ("lr_lambdas",):
            continue
        else:
            out[k] = v
    return out
