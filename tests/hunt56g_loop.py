"""A configurable training loop for tests/test_hunt56_review56g.py: save at step ``k``, train on to
``steps`` in the same process, and a resume from ``k`` in a new process, compared bytewise.

``train(rank, world, root, steps, save_at, resume_from, opts)`` runs under ``dist_helper.run_ranks``
(gloo ranks; ``opts["nodist"]`` leaves the process group first: a plain one-process loop). It returns
the loss bytes of each step it ran and the bytes of every tensor of the final state.

Parts switched on by ``opts``: a discriminator with an optimizer and scheduler of its own (``gan``),
the schedulers of each optimizer (``sched1``/``sched2``: ``seq``, ``chained``, ``onecycle``,
``plateau``, ``lambda``, ``step``), a ``GradScaler`` (``scaler``: enabled or not, ``autocast``),
gradient accumulation (``accum``), an SWA ``AveragedModel`` with ``SWALR`` (``swa``), a layer frozen
then unfrozen and a group added with ``add_param_group`` (``late``), the loop's own draws
(torch.randn, Python ``random``, NumPy), a DataLoader over ``ResumableSampler`` + ``SeededDataset``
with 2 workers (``workers``), DDP over the world.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

import trainguard as tg

N = 40


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(N, 6, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(6) + 0.01 * random.random() + 0.01 * float(np.random.rand()), self.y[i]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 1)
        self.late = nn.Linear(16, 1)  # trained from step ``late`` on (a group added then)
        self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.inp(x)))) * self.scale * 2
        return self.out(h) + 0.1 * self.late(h)


def _sched(kind: str, opt: Any, steps: int) -> Any:
    S = torch.optim.lr_scheduler
    if kind == "seq":
        return S.SequentialLR(opt, [S.LinearLR(opt, 0.2, total_iters=3), S.MultiStepLR(opt, [2, 5], 0.5)], milestones=[3])
    if kind == "chained":
        return S.ChainedScheduler([S.StepLR(opt, 2, 0.7), S.ExponentialLR(opt, 0.95)])
    if kind == "onecycle":
        return S.OneCycleLR(opt, max_lr=0.05, total_steps=steps + 2)
    if kind == "plateau":
        return S.ReduceLROnPlateau(opt, factor=0.5, patience=2, threshold=0.05, cooldown=1)
    if kind == "lambda":
        return S.LambdaLR(opt, lambda s: 0.9**s)
    if kind == "step":
        return S.StepLR(opt, 3, 0.5)
    if kind == "cyclic":
        return S.CyclicLR(opt, 0.001, 0.05, step_size_up=2, mode="exp_range", gamma=0.9,
                          cycle_momentum="momentum" in opt.defaults)
    if kind == "cyclic_fn":
        return S.CyclicLR(opt, 0.001, 0.05, step_size_up=2, scale_fn=lambda x: 0.8**x, cycle_momentum=False)
    if kind == "warm":
        return S.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=1e-4)
    if kind == "seqlambda":
        return S.SequentialLR(opt, [S.LambdaLR(opt, lambda s: (s + 1) / 3), S.PolynomialLR(opt, 8, 2.0)], milestones=[3])
    if kind == "chainmult":
        return S.ChainedScheduler([S.MultiplicativeLR(opt, lambda s: 0.97), S.ConstantLR(opt, 0.5, total_iters=5)])
    if kind == "plateau_max":
        return S.ReduceLROnPlateau(opt, mode="max", factor=0.7, patience=1, min_lr=[1e-3] * len(opt.param_groups))
    raise ValueError(kind)


def train(rank: int, world: int, root: str, steps: int, save_at: int, resume_from: int | None,
          opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import SWALR, AveragedModel

    if opts.get("nodist"):
        dist.destroy_process_group()
    torch.manual_seed(0)
    net = Net()
    late_at = opts.get("late")
    freeze_at = opts.get("unfreeze")
    ddp_kw = {"find_unused_parameters": True} if late_at is not None or freeze_at is not None else {}
    model = DDP(net, **ddp_kw) if dist.is_initialized() and opts.get("ddp", True) else net
    groups = [p for n, p in net.named_parameters() if not n.startswith("late.")]
    for p in net.late.parameters():
        p.requires_grad_(late_at is None)
    if late_at is None:
        groups = list(net.parameters())
    opt = {
        "adamw": lambda: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.01),
        "sgd": lambda: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
        "nadam": lambda: torch.optim.NAdam(groups, lr=0.01, decoupled_weight_decay=True, weight_decay=0.01),
        "radam": lambda: torch.optim.RAdam(groups, lr=0.01),
        "amsgrad": lambda: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
        "rmsprop": lambda: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5, centered=True),
        "adagrad": lambda: torch.optim.Adagrad(groups, lr=0.05),
        "adamax": lambda: torch.optim.Adamax(groups, lr=0.01),
        "asgd": lambda: torch.optim.ASGD(groups, lr=0.01, t0=2),
        "adadelta": lambda: torch.optim.Adadelta(groups, lr=1.0),
    }[opts.get("opt1", "adamw")]()
    sched = _sched(opts.get("sched1", "step"), opt, steps)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched}
    disc = dopt = dsched = None
    if opts.get("gan"):
        disc = nn.Sequential(nn.Linear(1, 8), nn.LeakyReLU(0.2), nn.Dropout(0.2), nn.Linear(8, 1))
        dopt = torch.optim.SGD(disc.parameters(), lr=0.02, momentum=0.5)
        if opts.get("dopt") == "adam":
            dopt = torch.optim.Adam(disc.parameters(), lr=0.002, betas=(0.5, 0.999))
        dsched = _sched(opts.get("sched2", "lambda"), dopt, steps)
        disc_m = DDP(disc) if dist.is_initialized() and opts.get("ddp", True) else disc
        state.update({"disc": disc_m, "dopt": dopt, "dsched": dsched})
    scaler = None
    if "scaler" in opts:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**opts.get("init_scale", 8), growth_interval=2,
                                      enabled=opts["scaler"])
        state["scaler"] = scaler
    swa = swa_sched = None
    if opts.get("swa") is not None:
        swa = AveragedModel(net)
        swa_sched = SWALR(opt, swa_lr=0.005, anneal_epochs=3)
        state.update({"swa": swa, "swa_sched": swa_sched})
    ds = Data()
    sampler = tg.ResumableSampler(ds, seed=3, shuffle=True, with_epoch=True)
    loader = torch.utils.data.DataLoader(tg.SeededDataset(ds, seed=11), batch_size=4, sampler=sampler,
                                         num_workers=opts.get("workers", 0), generator=torch.Generator(),
                                         worker_init_fn=tg.ignore_stop_signals if opts.get("workers") else None,
                                         persistent_workers=bool(opts.get("persistent")))
    progress = tg.StateDict(step=-1, micro=0)
    state.update({"data": sampler, "rng": tg.RNGState(), "progress": progress})
    for key in opts.get("leave_out", ()):  # a negative control: the comparison must see it
        del state[key]
    accum = opts.get("accum", 1)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    def add_late() -> None:
        for p in net.late.parameters():
            p.requires_grad_(True)
        opt.add_param_group({"params": list(net.late.parameters()), "lr": 0.003, "name": "late", "swa_lr": 0.001})

    def unfreeze(on: bool) -> None:
        net.inp.weight.requires_grad_(on)

    if freeze_at is not None:
        unfreeze(False)
    def snapshot() -> dict[str, Any]:
        final = {f"model/{k}": v.numpy().tobytes() for k, v in net.state_dict().items()}
        for i, s in enumerate(opt.state.values()):
            for k, v in s.items():
                final[f"optim/{i}/{k}"] = v.numpy().tobytes() if torch.is_tensor(v) else v
        final["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if disc is not None:
            final.update({f"disc/{k}": v.numpy().tobytes() for k, v in disc.state_dict().items()})
            final["dgroups"] = [{k: v for k, v in g.items() if k != "params"} for g in dopt.param_groups]
        if swa is not None:
            final.update({f"swa/{k}": v.numpy().tobytes() for k, v in swa.state_dict().items()})
        if scaler is not None:
            final["scaler"] = scaler.state_dict()
        final["rng"] = torch.get_rng_state().numpy().tobytes()
        final["pyrng"] = random.getstate()
        final["nprng"] = np.random.get_state()[1].tobytes()
        final["sampler"] = sampler.state_dict()
        final["sched"] = _plain(sched.state_dict())
        if dsched is not None:
            final["dsched"] = _plain(dsched.state_dict())
        return final

    log: dict[str, Any] = {"loss": {}, "lr": {}}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10**6), keep=tg.KeepAll(), handle_signals=False,
                              async_save=opts.get("async", False)) as mgr:
        if resume_from is not None:
            if late_at is not None and resume_from >= late_at:
                add_late()
            if freeze_at is not None and resume_from >= freeze_at:
                unfreeze(True)
            if opts.get("oneshot"):  # tg.load of the tg.save below, the manager idle
                tg.load(f"{root}/oneshot-{resume_from}", state)
            else:
                start = mgr.restore(state, step=resume_from)
                assert start == resume_from, start
            log["at_restore"] = snapshot()
        step = progress["step"] + 1

        def batches() -> Any:
            while True:
                yield from loader
                sampler.next_epoch()

        it = batches()
        while step < steps:
            if late_at is not None and step == late_at:
                add_late()
            if freeze_at is not None and step == freeze_at:
                unfreeze(True)
            total = torch.zeros(())
            for _ in range(accum):
                x, y = next(it)
                sampler.advance(len(x))
                x = x + 0.01 * torch.randn_like(x) + random.gauss(0, 0.01) + float(np.random.normal(0, 0.01))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.get("autocast", False)):
                    out = model(x)
                    loss = nn.functional.mse_loss(out.float(), y)
                if disc is not None:
                    g_loss = -disc_m(out.float()).mean() * 0.1
                    loss = loss + g_loss
                loss = loss / accum
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                total = total + loss.detach()
                progress["micro"] += 1
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad()
            if disc is not None:
                with torch.no_grad():
                    fake = model(x).float()
                dopt.zero_grad()
                d_loss = nn.functional.softplus(disc_m(fake)).mean() + nn.functional.softplus(-disc_m(y)).mean()
                if scaler is not None:
                    scaler.scale(d_loss).backward()
                    scaler.step(dopt)
                else:
                    d_loss.backward()
                    dopt.step()
                dopt.zero_grad()
                total = total + d_loss.detach()
                if isinstance(dsched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    dsched.step(_mean(d_loss.detach()))
                else:
                    dsched.step()
            if scaler is not None:
                scaler.update()
            if swa is not None and step >= opts["swa"]:
                swa.update_parameters(net)
                swa_sched.step()
            elif isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(_mean(total) * (-1 if sched.mode == 'max' else 1))
            else:
                sched.step()
            log["loss"][step] = total.numpy().tobytes()
            log.setdefault("scale", {})[step] = scaler.get_scale() if scaler is not None else None
            log["lr"][step] = [g["lr"] for g in opt.param_groups]
            progress["step"] = step
            if step == save_at:
                if opts.get("oneshot"):
                    tg.save(f"{root}/oneshot-{step}", state)
                else:
                    mgr.save(step, state, force=True)
                log["at_save"] = snapshot()
            step += 1
    final = snapshot()
    return {"log": log, "final": final}


def _plain(sd: dict[str, Any]) -> dict[str, Any]:
    """A scheduler's state without its functions (``lr_lambdas``), nested schedulers' too."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if k == "_schedulers":
            out[k] = [_plain(x) for x in v]
        elif k != "lr_lambdas" and not callable(v):
            out[k] = v
    return out


def _mean(t: Any) -> float:
    """``t`` averaged over the ranks (a plateau scheduler's metric must be equal on every rank)."""
    import torch.distributed as dist

    t = t.detach().clone().double()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()
