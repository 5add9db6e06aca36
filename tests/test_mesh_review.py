"""2-D meshes (4 gloo ranks as dp x tp = 2 x 2): FSDP2 over a tensor-parallel model, whose
parameters and Adam state carry torch's ``_StridedShard`` placement, saved sharded and full
and loaded at other world sizes and meshes, bit for bit against ``full_tensor()``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trainguard as tg

from dist_helper import cpu_mesh, full_state, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "5"}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 10 hidden rows: 5 per tp rank (TP needs even parts), 3 and 2 per dp rank; 5 output rows: 3 and 2
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))


def fsdp_tp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 on "dp" over a model made tensor-parallel on "tp" (column- then row-wise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model(seed)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()


def save_2x2_group(rank: int, world: int, root: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    model, opt = fsdp_tp(0)
    train(model, opt, 2)
    placements = str(model[0].weight.placements)
    ref = full_state(model, opt)
    tg.save(f"{root}/sharded", {"model": model, "optim": opt})
    tg.save(f"{root}/full", {"model": model, "optim": opt}, layout="full")
    fresh, fresh_opt = fsdp_tp(1)
    tg.load(f"{root}/sharded", {"model": fresh, "optim": fresh_opt})  # 2 x 2 -> 2 x 2
    same = full_state(fresh, fresh_opt)
    # A rank's rows that are not one run of the tensor cannot be one box: refused, saying so.
    mesh = model[0].weight.device_mesh
    odd = distribute_tensor(torch.arange(8.0).reshape(8, 1), mesh, (Shard(0), _StridedShard(0, split_factor=2)))
    try:
        tg.save(f"{root}/odd", {"odd": odd})
        refused = ""
    except tg.RankFailureError as e:
        refused = str(e)
    return {"placements": placements, "ref": ref, "same": same, "refused": refused}


def load_1d_group(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = make_model(2)
    fully_shard(model, mesh=cpu_mesh())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tg.load(f"{root}/sharded", {"model": model, "optim": opt})  # 2 x 2 -> 2 ranks, FSDP only
    return full_state(model, opt)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_over_tensor_parallel_saves_and_reshards_bit_for_bit(tmp_path: Path) -> None:
    root = str(tmp_path)
    r4 = run_ranks(save_2x2_group, 4, root, timeout=120, env=ENV)
    ref = r4[0].value["ref"]
    assert "_StridedShard" in r4[0].value["placements"]  # what this test is about
    assert len(ref) == 4 + 3 * 4  # 4 parameters, Adam's step/exp_avg/exp_avg_sq for each
    for r in r4:
        assert _equal(r.value["ref"], ref) and _equal(r.value["same"], ref)
        assert "cannot be saved or loaded as a box" in r.value["refused"], r.value["refused"]
    for r in run_ranks(load_1d_group, 2, root, timeout=120, env=ENV):
        assert _equal(r.value, ref)
    for name in ("sharded", "full"):  # offline, one process: whole tensors
        model = make_model(3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        tg.load(f"{root}/{name}", {"model": model, "optim": opt})
        assert _equal(full_state(model, opt), ref), name


def test_strided_offsets_match_torchs_own_split_or_refuse() -> None:
    """``strided_offsets`` against the indices torch's placements really give each mesh
    coordinate (``_split_tensor`` of an index tensor, no process group): the same first
    index when they are one run, a refusal when they are not (never a wrong box)."""
    import itertools

    import pytest
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainguard.dtensor import strided_offsets

    kinds = [Replicate(), Shard(0), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)]
    runs = refused = 0
    for n, mesh_shape in itertools.product((0, 1, 5, 7, 8, 11), [(2, 2), (3, 2), (2, 3)]):
        for placements in itertools.product(kinds, repeat=2):
            for coord in itertools.product(*map(range, mesh_shape)):
                rows = torch.arange(n)
                for md, p in enumerate(placements):
                    if not isinstance(p, Replicate):
                        rows = p._split_tensor(rows, mesh_shape[md], with_padding=False)[0][coord[md]]
                rows = rows.tolist()
                local = (len(rows), 2)
                if rows and rows != list(range(rows[0], rows[0] + len(rows))):
                    with pytest.raises(TypeError, match="cannot be saved or loaded as a box"):
                        strided_offsets((n, 2), mesh_shape, list(coord), placements, local)
                    refused += 1
                    continue
                assert strided_offsets((n, 2), mesh_shape, list(coord), placements, local) == (
                    rows[0] if rows else n, 0)
                runs += 1
    assert runs and refused


def tp_replicated_group(rank: int, world: int, root: str) -> dict:
    """Tensor parallel on "tp" of a dp x tp mesh, replicated over "dp" (DDP-style): each dp
    group holds the same parameters, as DTensors on its own slice ``mesh["tp"]``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model(seed)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, opt = build(0)
    train(model, opt, 2)  # the same batches on every rank: the dp replicas stay equal
    ref = full_state(model, opt)
    m = tg.save(f"{root}/tp", {"model": model, "optim": opt})
    fresh, fresh_opt = build(1)
    tg.load(f"{root}/tp", {"model": fresh, "optim": fresh_opt})
    return {"ref": ref, "same": full_state(fresh, fresh_opt), "chunk_bytes": sum(c.length for e in m.tensors.values() for c in e.chunks) if rank == 0 else None}


def test_tensor_parallel_replicated_over_dp_is_written_once_and_loads(tmp_path: Path) -> None:
    root = str(tmp_path)
    out = [r.value for r in run_ranks(tp_replicated_group, 4, root, timeout=120, env=ENV)]
    ref = out[0]["ref"]
    for o in out:
        assert _equal(o["ref"], ref) and _equal(o["same"], ref)
    # Each box written once (one dp replica), not once per replica.
    assert out[0]["chunk_bytes"] == sum(v.nbytes for v in ref.values())
    model = make_model(3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tg.load(f"{root}/tp", {"model": model, "optim": opt})  # offline, one process
    assert _equal(full_state(model, opt), ref)


def separate_meshes_group(rank: int, world: int, root: str) -> dict:
    """The same tensor on two device meshes built apart ([0, 1] and [2, 3], not slices of one)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_helper import attempt

    meshes = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]  # every rank makes both groups
    mesh = meshes[rank // 2]
    t = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    return attempt(lambda: tg.save(f"{root}/step-000000001", {"t": t}, timeout=30))


def test_a_save_no_load_would_accept_fails_instead_of_committing(tmp_path: Path) -> None:
    out = [r.value for r in run_ranks(separate_meshes_group, 4, str(tmp_path), timeout=90, env=ENV)]
    for o in out:  # before: committed, and every load failed "chunks cover 24 elements, the shape has 12"
        assert o["type"] == "CheckpointError", o
        assert "t: the ranks wrote 24 elements of its 12 (data-00000.bin and data-00002.bin both hold" in o["msg"], o
    assert not (tmp_path / "step-000000001").exists()
