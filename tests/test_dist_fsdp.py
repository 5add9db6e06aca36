"""FSDP2 (``fully_shard``) model + sharded Adam state across world sizes: 1 -> 2 -> 3 -> 1.

W=1 (this process) saves a plain model; a W=2 FSDP2 group loads it, trains and saves; a W=3
group loads that (full tensors equal bit for bit, bytes read per rank = its share), saves
sharded and ``layout="full"``; this process loads the W=3 checkpoint into a plain model and
consolidates the W=2 one offline.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

import trainguard as tg
from trainguard import io as tg_io
from trainguard.cli import main as cli

from dist_helper import cpu_mesh, full_state, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 1000), nn.ReLU(), nn.Linear(1000, 50))  # 50 rows: uneven over 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 40, generator=g), torch.randn(6, 50, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model, mesh = make_model(seed), cpu_mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def local_bytes(model: nn.Module) -> int:
    return sum(p.to_local().nbytes for p in model.parameters())


def w2_group(rank: int, world: int, root: str, w1_ref: dict) -> dict:
    model, opt = sharded(5)
    differed = not torch.equal(full_state(model, opt)["p/0.weight"], w1_ref["p/0.weight"])
    tg.load(f"{root}/w1/step-000000001", {"model": model, "optim": opt})  # 1 -> 2, optimizer state lazily created
    got = full_state(model, opt)
    train(model, opt, range(1, 3))
    tg.save(f"{root}/w2/step-000000003",
            {"model": model, "optim": opt, "progress": tg.StateDict(step=3), "rng": tg.RNGState()})
    return {"differed": differed, "loaded_equal": got.keys() == w1_ref.keys() and all(
        torch.equal(got[k], w1_ref[k]) for k in got), "ref": full_state(model, opt)}


def w3_group(rank: int, world: int, root: str, ref: dict) -> dict:
    model, opt = sharded(9)
    differed = not torch.equal(full_state(model, opt)["p/2.weight"], ref["p/2.weight"])
    before = tg_io.counters()["bytes_read"]
    tg.load(f"{root}/w2/step-000000003", {"model": model}, only=["model"], strict=False, verify=False)
    model_read = tg_io.counters()["bytes_read"] - before
    before = tg_io.counters()["bytes_read"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.load(f"{root}/w2/step-000000003",  # 2 -> 3
                {"model": model, "optim": opt, "progress": tg.StateDict(), "rng": tg.RNGState(reseed=3)})
    all_read = tg_io.counters()["bytes_read"] - before
    rng = torch.get_rng_state()
    got = full_state(model, opt)
    tg.save(f"{root}/w3/step-000000004", {"model": model, "optim": opt})
    tg.save(f"{root}/full/step-000000004", {"model": model, "optim": opt}, layout="full")
    return {"differed": differed, "equal": got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got),
            "model_read": model_read, "all_read": all_read, "local": local_bytes(model), "full": got,
            "rng": rng, "warnings": [str(x.message) for x in w]}


def _plain_load(path: str) -> dict[str, torch.Tensor]:
    model = make_model(11)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tg.load(path, {"model": model, "optim": opt}, strict=False)
    return full_state(model, opt)


def test_fsdp2_reshard_1_2_3_1_and_consolidate(tmp_path: Path) -> None:
    root = str(tmp_path)
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1))
    w1_ref = full_state(model, opt)
    tg.save(f"{root}/w1/step-000000001", {"model": model, "optim": opt})

    r2 = run_ranks(w2_group, 2, root, w1_ref, timeout=90, env=ENV)
    assert all(r.value["differed"] and r.value["loaded_equal"] for r in r2)
    ref = r2[0].value["ref"]

    r3 = run_ranks(w3_group, 3, root, ref, timeout=90, env=ENV)
    total_model = sum(v.nbytes for k, v in ref.items() if k.startswith("p/"))
    for r in r3:
        v = r.value
        assert v["differed"] and v["equal"]
        assert v["model_read"] == v["local"]  # exactly its own shard of the model, nothing else
        assert v["local"] < total_model / 2
    # Rank-local RNG, world grew 2 -> 3: ranks 0, 1 take saved ranks 0, 1; rank 2 is re-seeded
    # from (reseed, rank, the checkpoint's step), with a warning.
    tg.RNGState(reseed=3).reseed_for_rank(2, step=3)
    assert torch.equal(r3[2].value["rng"], torch.get_rng_state())
    assert any("re-seeded" in w for w in r3[2].value["warnings"])
    assert not torch.equal(r3[0].value["rng"], r3[2].value["rng"])
    # With verification (the default) reads widen to whole checksum blocks (4 MiB), here whole
    # saved chunks: ranks 0 and 2 overlap one W=2 chunk per tensor, rank 1 (the middle) both.
    total = sum(t.nbytes for t in ref.values())
    assert r3[0].value["all_read"] < 0.6 * total and r3[2].value["all_read"] < 0.6 * total

    # 3 -> 1 into a plain model and optimizer: whole tensors, bit for bit.
    got = _plain_load(f"{root}/w3/step-000000004")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

    # layout="full": one whole chunk per tensor, all in rank 0's file.
    full_dir = f"{root}/full/step-000000004"
    from trainguard.commit import read_manifest
    from trainguard.storage import for_path

    m = read_manifest(*for_path(full_dir))
    assert m.layout == "full" and list(m.files) == ["data-00000.bin"]
    assert all(len(e.chunks) <= 1 for e in m.tensors.values())
    got = _plain_load(full_dir)
    assert all(torch.equal(got[k], ref[k]) for k in ref)

    # Offline consolidation of the W=2 checkpoint (no process group).
    dst = f"{root}/consolidated/step-000000003"
    res = CliRunner().invoke(cli, ["consolidate", f"{root}/w2/step-000000003", dst])
    assert res.exit_code == 0, res.output
    m = read_manifest(*for_path(dst))
    assert m.layout == "full" and list(m.files) == ["data-00000.bin"] and m.step == 3
    assert all(len(e.chunks) <= 1 for e in m.tensors.values())
    got = _plain_load(dst)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
