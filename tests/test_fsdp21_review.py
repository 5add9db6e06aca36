"""FSDP on gloo CPU ranks, session 21's review.

A sharded FSDP1 optimizer's refusals (another optimizer class, another number of parameter
groups) ran in its ``load_state_dict``, at the entry's turn: the model entry before it was
already loaded, so a refused load left the state half-modified. They now run before anything is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from test_fsdp1_19_review import _fsdp1, _full, _step

from dist_helper import attempt, cpu_mesh, run_ranks


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(v, b[k]) if isinstance(v, dict) else torch.equal(v, b[k]) for k, v in a.items())


def _refused_fsdp1(rank: int, world: int, root: str) -> dict:
    m, o = _fsdp1(0, False)
    _step(m, o, 0)
    tg.save(f"{root}/c", {"model": m, "optim": o})
    out = {}
    for name in ("sgd", "groups"):
        m2, o2 = _fsdp1(5, False)
        _step(m2, o2, 7)
        if name == "sgd":
            opt = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        else:  # 2 groups (one a flat parameter), saved: 1
            opt = torch.optim.Adam([{"params": [p]} for p in m2.parameters()], lr=1e-2)
        before = _full(m2)
        out[name] = attempt(lambda opt=opt, m2=m2: tg.load(f"{root}/c", {"model": m2, "optim": opt}))
        out[name]["unchanged"] = _same(before, _full(m2))  # the model entry, loaded before the optimizer
        out[name]["differs"] = not _same(before, _full(m))
    return out


def test_refused_sharded_fsdp1_optimizer_leaves_the_state_unchanged(tmp_path: Path) -> None:
    """Before: the class check ran in the adapter's load_state_dict, after the model entry was
    read: the error came with the model holding the checkpoint's parameters."""
    for r in run_ranks(_refused_fsdp1, 2, str(tmp_path), timeout=90):
        sgd, groups = r.value["sgd"], r.value["groups"]
        assert sgd["type"] == "CheckpointError" and "holds the state of an Adam optimizer" in sgd["msg"], sgd
        assert sgd["msg"].startswith("entry 'optim': ")
        assert groups["type"] == "CheckpointError" and "1 parameter group(s), the state's 2" in groups["msg"], groups
        for v in (sgd, groups):
            assert v["differs"] and v["unchanged"], v


def _fsdp2(seed: int, **kw: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    """fully_shard per Linear and on the model, with ``kw`` (mp_policy, reshard_after_forward, mesh:
    by default the CPU mesh over the default group)."""
    from torch.distributed.fsdp import fully_shard

    kw.setdefault("mesh", cpu_mesh())
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    for layer in (m[0], m[2]):
        fully_shard(layer, **kw)
    fully_shard(m, **kw)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _eval_then_save(rank: int, world: int, root: str) -> dict:
    """An eval forward before the save and before the load: with reshard_after_forward=False it
    leaves the unsharded plain parameters registered in place of the optimizer's DTensors."""
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dist_helper import full_state

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), "reshard_after_forward": False}
    m, o = _fsdp2(0, **kw)
    for s in range(2):
        _step(m, o, s)
    with torch.no_grad():
        m(torch.randn(2, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tg.save(f"{root}/c", {"model": m, "optim": o})
    at = full_state(m, o)
    _step(m, o, 2)
    ref = full_state(m, o)
    m2, o2 = _fsdp2(1, **kw)
    _step(m2, o2, 9)
    differs = not _same(full_state(m2, o2), at)
    with torch.no_grad():
        m2(torch.randn(2, 8))
    got = attempt(lambda: tg.load(f"{root}/c", {"model": m2, "optim": o2}))
    loaded = _same(full_state(m2, o2), at)
    _step(m2, o2, 2)
    return {"warned": [str(w.message)[:200] for w in seen], "got": got, "differs": differs, "loaded": loaded,
            "resumed": _same(full_state(m2, o2), ref)}


def test_fsdp2_unsharded_by_an_eval_forward_saves_its_optimizer_by_name(tmp_path: Path) -> None:
    """FSDP2, MixedPrecisionPolicy(bf16), reshard_after_forward=False, per layer. Before: the save
    after an eval forward keyed the optimizer by index with a warning ("6 optimizer parameter(s)
    belong to no nn.Module"), and loading into a model built afresh was refused ("parameter group 0
    holds other parameters than at save time")."""
    for r in run_ranks(_eval_then_save, 2, str(tmp_path), timeout=90):
        v = r.value
        assert v["warned"] == [] and v["got"] == {"type": None}, v
        assert v["differs"] and v["loaded"] and v["resumed"], v
    manifest = "".join(p.read_text() for p in (tmp_path / "c").rglob("*.json"))
    assert "optim/state/0.weight/exp_avg" in manifest and "optim/state/0/exp_avg" not in manifest


def _hsdp(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """fully_shard per Linear and on the model: on 4 ranks over a 2 x 2 (replicate, shard) mesh
    (HSDP: DTensors with (Replicate(), Shard(0))), on 2 ranks plain FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if world == 4 else None
    return _fsdp2(seed, mesh=mesh)


def _hsdp_save(rank: int, world: int, root: str) -> dict:
    from dist_helper import full_state

    m, o = _hsdp(0, world)
    for s in range(2):
        _step(m, o, s)
    tg.save(f"{root}/c", {"model": m, "optim": o})
    at = full_state(m, o)
    _step(m, o, 2)
    return {"at": at, "ref": full_state(m, o), "placements": str(m[0].weight.placements)}


def _hsdp_resume(rank: int, world: int, root: str) -> dict:
    from dist_helper import full_state

    m, o = _hsdp(1, world)
    _step(m, o, 9)
    before = full_state(m, o)
    tg.load(f"{root}/c", {"model": m, "optim": o})
    loaded = full_state(m, o)
    _step(m, o, 2)
    return {"before": before, "loaded": loaded, "end": full_state(m, o)}


def test_hsdp_2x2_mesh_saved_on_4_ranks_resumes_on_2(tmp_path: Path) -> None:
    """FSDP2 HSDP on 4 ranks (2 replicas x 2 shards), resumed with plain FSDP2 on 2 ranks: the
    state equals the saved one and the next step is bit-identical to the run that went on."""
    saved = run_ranks(_hsdp_save, 4, str(tmp_path), timeout=120)
    v = saved[0].value
    assert v["placements"] == "(Replicate(), Shard(dim=0))"
    assert all(_same(r.value["ref"], v["ref"]) for r in saved)
    # each element once: 229 parameters, Adam's 2 moments (fp32) and 4 steps, not once per replica
    data = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file() and p.suffix != ".json")
    assert 229 * 3 * 4 <= data < 2 * 229 * 3 * 4, data
    for r in run_ranks(_hsdp_resume, 2, str(tmp_path), timeout=90):
        assert not _same(r.value["before"], v["at"])
        assert _same(r.value["loaded"], v["at"]) and _same(r.value["end"], v["ref"])


def _fsdp1_hybrid(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    m = FSDP(m, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"),
             auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _fsdp1_hybrid_run(rank: int, world: int, root: str) -> dict:
    m, o = _fsdp1_hybrid(0)
    for s in range(2):
        _step(m, o, s)
    tg.save(f"{root}/c", {"model": m, "optim": o})
    at = _full(m)
    _step(m, o, 2)
    ref = _full(m)
    m2, o2 = _fsdp1_hybrid(1)
    _step(m2, o2, 9)
    before = _full(m2)
    tg.load(f"{root}/c", {"model": m2, "optim": o2})
    loaded = _full(m2)
    _step(m2, o2, 2)  # equal to ref only with the optimizer's moments loaded too
    return {"shard": m2.process_group.size(), "differs": not _same(before, at), "loaded": _same(loaded, at),
            "resumed": _same(_full(m2), ref)}


def test_fsdp1_hybrid_shard_2x2_resumes_bit_identically(tmp_path: Path) -> None:
    """FSDP1 HYBRID_SHARD over a 2 x 2 device mesh on 4 gloo ranks (shard groups of 2): its
    optimizer goes through get/set_optimizer_state_dict; the resumed step is bit-identical."""
    for r in run_ranks(_fsdp1_hybrid_run, 4, str(tmp_path), timeout=120):
        assert r.value == {"shard": 2, "differs": True, "loaded": True, "resumed": True}, r.value
