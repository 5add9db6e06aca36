"""DDP + DTensor state saved at W=4 and resumed at W=2 (real ranks, gloo on 127.0.0.1).

One spawned group per world size; each checks several things (a spawn costs seconds here).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from trainguard import io as tg_io
from trainguard.loader import read_manifest
from trainguard.storage import for_path

from dist_helper import run_ranks

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4: the same global batch at every world size


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    for s in steps:
        x, y = batch(s, rank, world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # DDP averages: the global-batch mean gradient
        opt.step()


def table_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"rows": torch.randn(10, 6, generator=g), "cols": torch.randn(5, 9, generator=g), "rep": torch.randn(3, 3, generator=g)}


def table(world: int, values: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        "rows": distribute_tensor(values["rows"], mesh, [Shard(0)]),  # uneven: 10 rows over 4 ranks
        "cols": distribute_tensor(values["cols"], mesh, [Shard(1)]),
        "rep": distribute_tensor(values["rep"], mesh, [Replicate()]),
    }


def _state(model: nn.Module, world: int, values: dict[str, torch.Tensor]) -> dict:
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return {"model": ddp, "optim": opt, "table": table(world, values), "rng": tg.RNGState(),
            "progress": tg.StateDict(step=0)}


def _cpu_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    sd = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
    }


def save_group(rank: int, world: int, root: str) -> dict:
    state = _state(make_model(0), world, table_values())
    train(state["model"], state["optim"], range(3), rank, world)
    state["progress"]["step"] = 2
    before = tg_io.counters()["bytes_written"]
    m = tg.save(f"{root}/step-000000002", state)
    written = tg_io.counters()["bytes_written"] - before
    kind = type(m).__name__  # ranks > 0 get a LazyManifest: step and size without reading manifest.json
    summary = (m.step, m.total_bytes, m.__dict__.get("_full") is None)  # read before .files below
    return {"written": written, "files": m.files, "kind": kind, "summary": summary,
            "saved": _cpu_state(state["model"].module, state["optim"]), "rng": torch.get_rng_state()}


def resume_group(rank: int, world: int, root: str, more: int) -> dict:
    zeros = {k: torch.zeros_like(v) for k, v in table_values().items()}
    state = _state(make_model(1), world, zeros)
    fresh = _cpu_state(state["model"].module, state["optim"])
    before = tg_io.counters()["bytes_read"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.load(f"{root}/step-000000002", state)
    read = tg_io.counters()["bytes_read"] - before
    loaded = _cpu_state(state["model"].module, state["optim"])
    full = {k: v.full_tensor() for k, v in state["table"].items()}
    local = {k: v.to_local().clone() for k, v in state["table"].items()}
    rng = torch.get_rng_state()
    step = state["progress"]["step"]
    train(state["model"], state["optim"], range(3, 3 + more), rank, world)
    state["progress"]["step"] = 2 + more
    tg.save(f"{root}/step-{2 + more:09d}", state)  # saved at W=2, resumed at W=1 by the test
    return {"fresh": fresh, "loaded": loaded, "full": full, "local": local, "read": read, "rng": rng,
            "step": step, "warnings": [str(x.message) for x in w],
            "after": {k: v.clone() for k, v in state["model"].module.state_dict().items()}}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a
    )


def test_ddp_and_dtensor_saved_at_4_resume_at_2(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_ranks(save_group, 4, root, timeout=90, env={"TRAINGUARD_DEAD_AFTER": "3"})
    # Replicated tensors are written once in total, balanced over the ranks.
    m = read_manifest(*for_path(f"{root}/step-000000002"))
    rep_bytes = sum(e.nbytes for p, e in m.tensors.items() if p.startswith(("model/", "optim/")))
    written = [r.value["written"] for r in saved]
    assert sum(written) >= rep_bytes
    assert len(m.files) == 4 and all(w > 0 for w in written)
    assert max(written) < 0.5 * rep_bytes, written  # not "rank 0 writes everything"
    ref = saved[0].value["saved"]
    assert all(_equal(r.value["saved"], ref) for r in saved)  # DDP kept the replicas identical
    # Every rank's save() result: rank 0 the manifest it built, the others a lazy one that knew
    # step and size before reading anything, and reads the same files on demand.
    assert [r.value["kind"] for r in saved] == ["Manifest", "LazyManifest", "LazyManifest", "LazyManifest"]
    assert all(r.value["summary"][:2] == (2, m.total_bytes) for r in saved)
    assert all(r.value["summary"][2] for r in saved[1:])  # nothing read for step/total_bytes
    assert all(r.value["files"] == m.files for r in saved)

    more = 2
    res = run_ranks(resume_group, 2, root, more, timeout=90, env={"TRAINGUARD_DEAD_AFTER": "3"})
    vals = table_values()
    for r in res:
        v = r.value
        assert not _equal(v["fresh"]["model"], ref["model"]) and not v["fresh"]["optim"]  # differed before
        assert _equal(v["loaded"], ref)  # bit for bit after
        assert all(torch.equal(v["full"][k], vals[k]) for k in vals)
        assert torch.equal(v["local"]["rows"], vals["rows"].chunk(2)[r.rank])
        assert v["step"] == 2
        # Rank-local RNG: rank r < 2 takes saved rank r's generator state, with a warning.
        assert torch.equal(v["rng"], saved[r.rank].value["rng"])
        assert any("saved by 4 ranks" in w for w in v["warnings"])
    # Each rank read the replicated bytes plus only its own share of the sharded table.
    shard = sum(vals[k].nbytes for k in ("rows", "cols")) // 2
    table_bytes = sum(v.nbytes for v in vals.values())
    for r in res:
        own = rep_bytes + vals["rep"].nbytes + sum(e.nbytes for p, e in m.tensors.items() if p.startswith(f"rng@{r.rank}/"))
        # checksum verification widens a read to whole chunks here (they are smaller than a block)
        assert own + shard <= r.value["read"] < own + table_bytes, (own, shard, r.value["read"])

    # Reference continuation in this process (W=1, the same global batches).
    model = make_model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tg.load(f"{root}/step-000000002", {"model": model, "optim": opt}, strict=False)
    assert _equal(_cpu_state(model, opt), ref)
    train(model, opt, range(3, 3 + more), 0, 1)
    for r in res:
        for k, t in model.state_dict().items():
            torch.testing.assert_close(r.value["after"][k], t, rtol=1e-5, atol=1e-6)

    # 2 -> 1: the W=2 group's checkpoint, loaded here, holds exactly what that group trained.
    resumed = make_model(3)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    tg.load(f"{root}/step-{2 + more:09d}", {"model": resumed, "optim": opt2}, strict=False)
    assert _equal({k: v for k, v in resumed.state_dict().items()}, res[0].value["after"])
    train(resumed, opt2, range(3 + more, 5 + more), 0, 1)
    train(model, opt, range(3 + more, 5 + more), 0, 1)
    for k, t in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], t, rtol=1e-5, atol=1e-6)
