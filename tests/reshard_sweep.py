"""The resharding matrix: save on W gloo ranks, load on W' ranks, compare with the truth.

Each save group builds one state of every kind a resharding load meets and trains it two steps:

- ``ddp``/``dopt``: a replicated ``DistributedDataParallel`` MLP and its AdamW;
- ``fs``/``fopt``: an FSDP2 (``fully_shard``) MLP of 7, 2 and 1 rows (uneven; zero-size shards
  from 2 ranks on) and its Adam;
- ``tf``/``topt``: FSDP2 over a tensor-parallel MLP on a 2-D ("a", "b") mesh (``_StridedShard``
  on 2 x 2) and its Adam;
- ``tp``: DTensors on a 1-D mesh (13 and 7 rows, ``Shard(1)`` of 3 columns, 3 and 2 rows: zero-size
  shards, bf16, 1-D) and on the 2-D mesh (``Shard(0), Shard(1)``, ``Replicate`` with ``Shard``);
- ``local`` (``trainguard_rank_local``) and ``rng`` (``tg.RNGState``): rank-local entries;
- eight ``ResumableSampler`` (23 samples, shuffle on/off, drop_last on/off, a position one batch
  into the epoch or within 4 samples of its end), read in batches of 4 per rank.

Rank 0 writes the whole tensors (``full_tensor``) next to the checkpoints as the truth; a load
group builds the state afresh (other seeds, a fresh optimizer without state), loads, gathers
every tensor and compares with ``torch.equal``, then reads every sampler to the end of the epoch.
:func:`cell_problems` says what is wrong in one (W, W', variant) cell.

As a script (the whole matrix; ``PYTHONPATH=src:tests``)::

    python tests/reshard_sweep.py ROOT [VARIANTS] [SAVE_WORLDS]
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainguard as tg

from dist_helper import cpu_mesh, describe, full_state, run_ranks

N = 23  # samples; a batch of 4 per rank does not divide it
B = 4
SAMPLERS = [(s, d, k) for s in (False, True) for d in (False, True) for k in ("start", "end")]
SAVES: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"async_": True},
    "full": {"layout": "full"},
    "split": {"split_state": True},
    "tiny": {"async_": True, "max_staging_bytes": 256},
    "bg": {"async_": True, "stage_in_background": True},
}
MANAGED = ("mgr", "ram")  # CheckpointManager(async_save=True), and with a RAM tier
VARIANTS = (*SAVES, *MANAGED)
ENV = {"TRAINGUARD_DEAD_AFTER": "5", "TRAINGUARD_TIMEOUT": "60"}


class Local:
    """A rank-local entry that is not an RNGState: at W' > W rank r takes saved rank r % W's."""

    trainguard_rank_local = True

    def __init__(self, v: int) -> None:
        self.v = v

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v, "t": torch.full((3,), float(self.v))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.v = int(sd["v"])
        assert torch.equal(sd["t"], torch.full((3,), float(self.v)))


def mesh2(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[world]
    return init_device_mesh("cpu", shape, mesh_dim_names=("a", "b"))


def build(rank: int, world: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state (every rank) and the modules/optimizers whose whole tensors :func:`truth` takes."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    ddp_mod = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    ddp = nn.parallel.DistributedDataParallel(ddp_mod)
    dopt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    fs = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 2), nn.Linear(2, 1))
    for layer in fs:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(fs, mesh=cpu_mesh())
    fopt = torch.optim.Adam(fs.parameters(), lr=1e-2)
    tf = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))
    m2 = mesh2(world)
    parallelize_module(tf, m2["b"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(tf, mesh=m2["a"])
    topt = torch.optim.Adam(tf.parameters(), lr=1e-2)
    mesh, g = cpu_mesh(), torch.Generator().manual_seed(seed + 1)
    tp = {
        "a": distribute_tensor(torch.randn(13, 5, generator=g), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(7, 3, generator=g), mesh, [Shard(1)]),
        "c": distribute_tensor(torch.randn(3, 4, generator=g), mesh, [Shard(0)]),
        "d2": distribute_tensor(torch.randn(13, 7, generator=g), m2, [Shard(0), Shard(1)]),
        "e": distribute_tensor(torch.randn(2, 5, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
        "f": distribute_tensor(torch.randn(5, generator=g), mesh, [Shard(0)]),
        "rs": distribute_tensor(torch.randn(7, 5, generator=g), m2, [Replicate(), Shard(0)]),
        "sr": distribute_tensor(torch.randn(5, 3, generator=g), m2, [Shard(1), Replicate()]),
    }
    samplers = {f"s{int(s)}{int(d)}{k}": tg.ResumableSampler(N, seed=seed, shuffle=s, drop_last=d, rank=rank, world_size=world)
                for s, d, k in SAMPLERS}
    state = {"ddp": ddp, "dopt": dopt, "fs": fs, "fopt": fopt, "tf": tf, "topt": topt, "tp": tg.StateDict(tp),
             "local": Local(100 + rank), "rng": tg.RNGState(), "progress": tg.StateDict(step=0), **samplers}
    return state, {"ddp": ddp_mod, "dopt": dopt, "fs": fs, "fopt": fopt, "tf": tf, "topt": topt}


def truth(state: dict[str, Any], mods: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every parameter, optimizer state tensor (exp_avg, exp_avg_sq, step) and DTensor, whole (collective)."""
    out = {}
    for m, o in (("ddp", "dopt"), ("fs", "fopt"), ("tf", "topt")):
        out.update({f"{m}/{k}": v for k, v in full_state(mods[m], mods[o]).items()})
    out.update({f"tp/{k}": v.full_tensor() for k, v in state["tp"].items()})
    return out


def train(state: dict[str, Any], mods: dict[str, Any], rank: int, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        for opt, model, x, f in (("dopt", state["ddp"], torch.randn(4, 5, generator=g), torch.sum),
                                 ("fopt", mods["fs"], torch.randn(4, 13, generator=g), lambda y: y.pow(2).sum()),
                                 ("topt", mods["tf"], torch.randn(4, 6, generator=torch.Generator().manual_seed(s)),
                                  lambda y: y.square().mean())):
            mods[opt].zero_grad()
            f(model(x)).backward()
            mods[opt].step()


def consume(sampler: tg.ResumableSampler, batches: int | None) -> list[int]:
    """Read ``batches`` batches of B (None: to the epoch's end), advancing by each batch's length."""
    got: list[int] = []
    it = list(iter(sampler))
    for n, i in enumerate(range(0, len(it), B)):
        if batches is not None and n == batches:
            break
        got += it[i:i + B]
        sampler.advance(len(it[i:i + B]))
    return got


def _read_before_save(state: dict[str, Any], world: int) -> dict[str, list[int]]:
    seen = {}
    for name, smp in state.items():
        if not isinstance(smp, tg.ResumableSampler):
            continue
        if name.endswith("start"):
            seen[name] = consume(smp, 1)
            continue
        got = []
        while N - smp.position >= B * world:  # whole batches, then single samples until < B remain
            got += consume(smp, 1)
        while N - smp.position >= B:
            got.append(next(iter(smp)))
            smp.advance(1)
        seen[name] = got
    return seen


def save_group(rank: int, world: int, root: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """Train, read the samplers partway, write the truth (rank 0) and save each variant."""
    state, mods = build(rank, world, 0)
    train(state, mods, rank, 2)
    seen = _read_before_save(state, world)
    state["progress"]["step"] = 2
    t = truth(state, mods)
    if rank == 0:
        torch.save(t, f"{root}/truth-w{world}.pt")
    for v in variants:
        if v in SAVES:
            h = tg.save(f"{root}/w{world}-{v}", state, **SAVES[v])
            if SAVES[v].get("stage_in_background"):
                h.wait_staged()
            if SAVES[v].get("async_"):
                h.result()
        else:
            ram = {"ram_tier": f"{root}/shm"} if v == "ram" else {}
            mgr = tg.CheckpointManager(f"{root}/{v}-w{world}", async_save=True, save=tg.EveryNSteps(1), **ram)
            mgr.open()
            mgr.save(2, state)
            mgr.close(keep_ram_tier=True)
    return {"seen": seen, "positions": {k: v.position for k, v in state.items() if isinstance(v, tg.ResumableSampler)}}


def load_group(rank: int, world: int, root: str, w: int, variant: str) -> dict[str, Any]:
    """Build afresh, load the checkpoint of ``w`` ranks, compare and read the samplers on."""
    state, mods = build(rank, world, 7)
    t = torch.load(f"{root}/truth-w{w}.pt")
    before = truth(state, mods)
    res: dict[str, Any] = {"error": None, "mismatch": [], "equal_before": sorted(k for k in before if k in t and torch.equal(before[k], t[k]))}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank-local "taking saved rank r's" warnings: checked by value below
            if variant in MANAGED:
                ram = {"ram_tier": f"{root}/shm"} if variant == "ram" else {}
                with tg.CheckpointManager(f"{root}/{variant}-w{w}", save=tg.EveryNSteps(1000), **ram) as mgr:
                    res["restored"] = mgr.restore(state)
                    if variant == "ram":
                        mgr.close(keep_ram_tier=True)  # other cells restore from it
            else:
                tg.load(f"{root}/w{w}-{variant}", state, split_state=SAVES[variant].get("split_state", False))
    except Exception:
        res["error"] = traceback.format_exc()
        return res
    got = truth(state, mods)
    for k in sorted(set(t) | set(got)):
        if k not in t or k not in got:
            res["mismatch"].append(f"{k}: missing from the {'truth' if k not in t else 'loaded state'}")
        elif not torch.equal(t[k], got[k]):
            res["mismatch"].append(f"{k}: differs")
    res["local"], res["step"] = state["local"].v, state["progress"]["step"]
    res["after"] = {k: consume(v, None) for k, v in state.items() if isinstance(v, tg.ResumableSampler)}
    return res


def sampler_problem(name: str, before: list[list[int]], after: list[list[int]], w2: int) -> str | None:
    """docs/data.md: every sample of the epoch once (drop_last=False: plus at most W' - 1 padding
    duplicates of the epoch's first ones); drop_last=True: none twice, fewer than W' skipped."""
    shuffle, drop_last = bool(int(name[1])), bool(int(name[2]))
    order = tg.ResumableSampler(N, seed=0, shuffle=shuffle, rank=0, world_size=1).order(0)
    counts = [len(a) for a in after]
    if len(set(counts)) != 1:
        return f"{name}: the ranks read different counts after the resume: {counts}"
    c = Counter([x for r in before for x in r] + [x for r in after for x in r])
    missing = [x for x in order if c[x] == 0]
    dups = {x: n - 1 for x, n in c.items() if n > 1}
    if not drop_last and (missing or sum(dups.values()) > w2 - 1 or any(x not in order[:w2 - 1] for x in dups)):
        return f"{name}: missing {missing}, repeated {dups}"
    if drop_last and (dups or len(missing) >= w2):
        return f"{name}: missing {missing}, repeated {dups} (drop_last)"
    return None


def cell_problems(saved: list[dict[str, Any]], loaded: list[dict[str, Any]], w: int, w2: int) -> list[str]:
    """What is wrong in one cell; [] when everything loaded equals the truth."""
    out = []
    for r, v in enumerate(loaded):
        if v["error"]:
            return [f"rank {r}: {v['error']}"]
        if v["mismatch"]:
            out.append(f"rank {r}: {v['mismatch']}")
        if v["equal_before"]:
            out.append(f"rank {r}: equal to the truth before the load, proves nothing: {v['equal_before']}")
        if v["step"] != 2 or v.get("restored", 2) != 2:
            out.append(f"rank {r}: step {v['step']}, restored {v.get('restored')}")
        if r < w and v["local"] != 100 + r or r >= w and v["local"] != 100 + r % w:
            out.append(f"rank {r}: rank-local value {v['local']}")
    for name in loaded[0]["after"]:
        p = sampler_problem(name, [s["seen"][name] for s in saved], [v["after"][name] for v in loaded], w2)
        if p:
            out.append(f"{p} (saved at position {saved[0]['positions'][name]})")
    return out


def sweep(root: str, variants: tuple[str, ...] = VARIANTS, save_worlds: tuple[int, ...] = (1, 2, 3),
          load_worlds: tuple[int, ...] = (1, 2, 3, 4), log: Any = None) -> list[str]:
    """Every cell; returns the problems found ([] when none)."""
    (Path(root) / "shm").mkdir(parents=True, exist_ok=True)  # the "ram" variant's RAM tier
    problems: list[str] = []
    for w in save_worlds:
        t0 = time.monotonic()
        res = run_ranks(save_group, w, root, variants, timeout=180, env=ENV, check=False)
        if log:
            log(f"save W={w}: {time.monotonic() - t0:.1f} s")
        if not all(r.ok for r in res):
            problems.append(f"save W={w} failed:\n{describe(res)}")
            continue
        saved = [r.value for r in res]
        for w2 in load_worlds:
            for variant in variants:
                t0 = time.monotonic()
                res = run_ranks(load_group, w2, root, w, variant, timeout=180, env=ENV, check=False)
                tag = f"W={w} -> W'={w2} {variant}"
                if log:
                    log(f"load {tag}: {time.monotonic() - t0:.1f} s")
                if not all(r.ok for r in res):
                    problems.append(f"{tag} crashed:\n{describe(res)}")
                    continue
                problems += [f"{tag}: {p}" for p in cell_problems(saved, [r.value for r in res], w, w2)]
    return problems


if __name__ == "__main__":
    args = sys.argv[1:]
    found = sweep(args[0], tuple(args[1].split(",")) if len(args) > 1 else VARIANTS,
                  tuple(int(x) for x in args[2].split(",")) if len(args) > 2 else (1, 2, 3), log=print)
    print("\n".join(found) if found else "ALL OK")
