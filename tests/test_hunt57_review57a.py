"""Session 57, review57a: a hostile review of resharding on load when the world size changes.

- A checkpoint of FSDP2 ranks (format 2: regular parts) with one rank's ``data-0000R.bin`` or
  ``data-0000R.idx`` gone loaded on any world size overwrote the parameters on every rank and only
  then raised "the state may hold part of the checkpoint's values": the files of regular parts read
  into a live shard, and their indexes, were checked when first opened, in the middle of the reads
  (a DDP checkpoint missing the same file was refused before anything was read). Now every file a
  rank reads, and every index, is checked before the load's plan round: each rank raises before any
  rank wrote into its state, and the message says which ranks saved it and what to do. A missing
  index said "data file is missing"; it now says "index file is missing".
- Coverage the matrix of tests/reshard_sweep.py lacks: saved on 4 ranks (the sweep saves on 1-3),
  AdamW with two parameter groups, SGD with (nesterov) momentum, three LR schedulers, DTensors of
  int64/bool/bf16/int8/uint8/float16/complex64/float64 dtypes, 0-size ones (``[0, 5]``, ``[5, 0]``
  sharded on either dim), dims smaller than the world, loaded into an optimizer that already has
  state (some parameters only); and a consolidated (``layout="full"``) save of 4 ranks loaded on 2.
"""

from __future__ import annotations

import shutil
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainguard as tg

from dist_helper import cpu_mesh, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "5", "TRAINGUARD_TIMEOUT": "60"}


def _fsdp(mod: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in mod:
        fully_shard(layer, mesh=cpu_mesh())
    return fully_shard(mod, mesh=cpu_mesh())


def _build(seed: int) -> tuple[dict[str, Any], nn.Module]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(seed)
    mesh = cpu_mesh()
    fs = _fsdp(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3), nn.Linear(3, 1)))  # 10 rows over 3 or 4; 3 and 1 < 4
    fopt = torch.optim.AdamW([{"params": list(fs[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
                              {"params": [*fs[1].parameters(), *fs[2].parameters()], "lr": 3e-3, "weight_decay": 0.0}])
    sg = _fsdp(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2)))
    sopt = torch.optim.SGD(sg.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    dm = nn.Sequential(nn.Linear(4, 10), nn.Linear(10, 3))
    ddp = nn.parallel.DistributedDataParallel(dm)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    dt = {
        "i64": distribute_tensor(torch.randint(-2**40, 2**40, (10, 3), generator=g), mesh, [Shard(0)]),
        "bool": distribute_tensor(torch.rand(10, generator=g) > 0.5, mesh, [Shard(0)]),
        "bf16": distribute_tensor(torch.randn(3, 10, generator=g).bfloat16(), mesh, [Shard(1)]),
        "z0": distribute_tensor(torch.randn(0, 5, generator=g), mesh, [Shard(0)]),
        "z1": distribute_tensor(torch.randn(5, 0, generator=g), mesh, [Shard(0)]),
        "z2": distribute_tensor(torch.randn(5, 0, generator=g), mesh, [Shard(1)]),
        "i8": distribute_tensor(torch.randint(-128, 127, (2,), generator=g, dtype=torch.int8), mesh, [Shard(0)]),
        "u8": distribute_tensor(torch.randint(0, 255, (3, 1), generator=g, dtype=torch.uint8), mesh, [Shard(0)]),
        "f16": distribute_tensor(torch.randn(7, 3, generator=g).half(), mesh, [Shard(1)]),
        "c64": distribute_tensor(torch.randn(5, generator=g, dtype=torch.complex64), mesh, [Shard(0)]),
        "f64": distribute_tensor(torch.randn(1, 1, generator=g, dtype=torch.float64), mesh, [Shard(0)]),
        "i32r": distribute_tensor(torch.randint(-2**30, 2**30, (4,), generator=g, dtype=torch.int32), mesh, [Replicate()]),
    }
    state = {"fs": fs, "fopt": fopt, "fsch": torch.optim.lr_scheduler.StepLR(fopt, step_size=1, gamma=0.7),
             "sg": sg, "sopt": sopt, "ssch": torch.optim.lr_scheduler.MultiStepLR(sopt, milestones=[1, 3], gamma=0.5),
             "ddp": ddp, "dopt": dopt, "dsch": torch.optim.lr_scheduler.CosineAnnealingLR(dopt, T_max=5),
             "dt": tg.StateDict(dt), "plain": tg.StateDict(pz=torch.zeros(0, 3), pb=torch.rand(6, generator=g) > 0.5),
             "progress": tg.StateDict(step=0)}
    return state, dm


def _whole(t: Any) -> Any:
    return t.full_tensor().clone() if hasattr(t, "full_tensor") else t.clone() if torch.is_tensor(t) else torch.tensor(t)


def _truth(state: dict[str, Any], dm: nn.Module) -> dict[str, Any]:
    """Every parameter, optimizer state tensor, group hyperparameter, scheduler state and DTensor, whole (collective)."""
    out: dict[str, Any] = {}
    for mn, on, m in (("fs", "fopt", state["fs"]), ("sg", "sopt", state["sg"]), ("ddp", "dopt", dm)):
        names = {id(p): n for n, p in m.named_parameters()}
        out.update({f"{mn}/{n}": _whole(p.detach()) for n, p in m.named_parameters()})
        out.update({f"{on}/{names[id(p)]}/{k}": _whole(v) for p, s in state[on].state.items() for k, v in s.items()})
        out.update({f"{on}/{i}/{k}": repr(v) for i, gr in enumerate(state[on].param_groups) for k, v in gr.items() if k != "params"})
    out.update({f"{e}/{k}": _whole(v) for e in ("dt", "plain") for k, v in state[e].items()})
    out.update({k: repr(sorted(state[k].state_dict().items())) for k in ("fsch", "ssch", "dsch")})
    return out


def _train(state: dict[str, Any], rank: int, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        for mn, on, sch, x in (("fs", "fopt", "fsch", torch.randn(4, 10, generator=g)), ("sg", "sopt", "ssch", torch.randn(4, 10, generator=g)),
                               ("ddp", "dopt", "dsch", torch.randn(4, 4, generator=g))):
            state[on].zero_grad()
            state[mn](x).pow(2).sum().backward()
            state[on].step()
            state[sch].step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _save(rank: int, world: int, root: str) -> None:
    state, dm = _build(0)
    _train(state, rank, 2)
    state["progress"]["step"] = 2
    truth = _truth(state, dm)
    if rank == 0:
        torch.save(truth, f"{root}/truth.pt")
    tg.save(f"{root}/sharded", state)
    tg.save(f"{root}/full", state, layout="full")


def _load_one(rank: int, root: str, which: str, trained: bool) -> dict[str, Any]:
    state, dm = _build(7)
    if trained:  # an optimizer with state, the first parameter's dropped: read in place and into new shards
        _train(state, rank + 5, 1)
        state["fopt"].state.pop(next(iter(state["fopt"].state)))
    truth = torch.load(f"{root}/truth.pt")
    before = _truth(state, dm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg.load(f"{root}/{which}", state)
    got = _truth(state, dm)
    _train(state, rank, 1)  # the loaded shards train on
    return {"differ": sorted(k for k in set(truth) | set(got) if k not in truth or k not in got or not _same(truth[k], got[k])),
            "equal_before": sorted(k for k in truth if k in before and _same(truth[k], before[k]) and not k.startswith(("dt/z", "plain/pz"))),
            "step": state["progress"]["step"]}


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"sharded": _load_one(rank, root, "sharded", True), "full": _load_one(rank, root, "full", False)}


def test_saved_on_4_ranks_loads_on_3_bit_for_bit(tmp_path: Path) -> None:
    """Sharded into a state built afresh whose optimizers already stepped (one parameter without state); the
    consolidated save of the same state into a fresh one. Every tensor gathered equals the copy taken at save."""
    root = str(tmp_path)
    run_ranks(_save, 4, root, timeout=120, env=ENV)
    out = [r.value for r in run_ranks(_load, 3, root, timeout=120, env=ENV)]
    truth = torch.load(f"{root}/truth.pt")
    assert len([k for k in truth if k.startswith("fopt/") and k.endswith("/exp_avg")]) == 6
    assert len([k for k in truth if k.startswith(("sopt/", "dopt/")) and k.endswith("momentum_buffer")]) == 8
    for v in (x[which] for x in out for which in ("sharded", "full")):
        assert v["differ"] == [] and v["step"] == 2, v
        assert [k for k in v["equal_before"] if not k.startswith(("fopt/", "sopt/", "dopt/"))] == [], v["equal_before"]


def _save_fsdp(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    tg.save(f"{root}/fsdp", {"model": _fsdp(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3)))})


def _load_damaged(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each damaged copy: the error, and the names of the parameters the failed load changed (none)."""
    torch.manual_seed(5)
    model = _fsdp(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3)))
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    out = {}
    for case in ("no-data", "no-index"):
        try:
            tg.load(f"{root}/{case}", {"model": model})
            out[case] = {"error": None}
        except tg.CheckpointError as e:
            out[case] = {"error": str(e)}
        except Exception:  # noqa: BLE001 - reported to the test
            out[case] = {"error": "unexpected: " + traceback.format_exc()}
        out[case]["changed"] = [k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), before[k])]
    return out


def test_a_missing_rank_file_is_refused_on_every_rank_before_any_rank_writes(tmp_path: Path) -> None:
    """Saved by 3 FSDP2 ranks, ``data-00002.bin`` or ``data-00002.idx`` gone, loaded on 2: before, every rank's
    parameters were overwritten (rank 0 read its parts, rank 1 part of its own) and then the load raised."""
    root = str(tmp_path)
    run_ranks(_save_fsdp, 3, root, timeout=120, env=ENV)
    for case, gone in (("no-data", "data-00002.bin"), ("no-index", "data-00002.idx")):
        shutil.copytree(f"{root}/fsdp", f"{root}/{case}")
        (tmp_path / case / gone).unlink()
    out = [r.value for r in run_ranks(_load_damaged, 2, root, timeout=120, env=ENV)]
    for case, gone, what in (("no-data", "data-00002.bin", "data file is missing"), ("no-index", "data-00002.idx", "index file is missing")):
        for rank, v in enumerate(out):
            err = v[case]["error"]
            assert err is not None and f"{case}/{gone}: {what}" in err, (rank, err)
            assert "saved by 3 rank(s)" in err and "copy the checkpoint directory whole, or load another checkpoint" in err, err
            assert "had begun writing" not in err, err
            assert v[case]["changed"] == [], (rank, case, v[case])
        assert "failed on rank(s) [1]" in out[0][case]["error"]  # rank 1 reads part 2; rank 0 was told
