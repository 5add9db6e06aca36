"""FSDP1 (``FullyShardedDataParallel``) on 2 gloo CPU ranks (``device_id=torch.device("cpu")``:
without it torch 2.13 refuses CPU, "FSDP needs a non-CPU accelerator device").

A sharded FSDP1 optimizer holds each rank's shard of flattened parameters: it was saved from one
rank for all (``use_orig_params=False``: a warning, then a resume that differed from the run) or
refused with the advice ``split_state=True`` (``True``). Both are now refused before anything is
written or read, naming FSDP2; so is an FSDP1 model under a ``state_dict_type`` that does not give
every rank full tensors. What works is checked too: the FSDP1 model alone (full tensors by name)
resumes bit-identically and loads into FSDP2 and into a plain model; ``NO_SHARD`` with its
optimizer resumes bit-identically.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, cpu_mesh, run_ranks


def _fsdp1(seed: int, uop: bool, strategy: str = "FULL_SHARD", wrap: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    kw = {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear})} if wrap else {}
    m = FSDP(m, use_orig_params=uop, sharding_strategy=getattr(ShardingStrategy, strategy),
             device_id=torch.device("cpu"), **kw)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _step(m: nn.Module, o: torch.optim.Optimizer, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
    o.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()
    o.step()


def _full(m: nn.Module) -> dict[str, torch.Tensor]:
    """The FSDP1 model's full parameters by name (collective)."""
    return {k: v.clone() for k, v in m.state_dict().items()}


def _optimizer_alone(rank: int, world: int, root: str, uop: bool) -> dict:
    """A sharded FSDP1 optimizer in a state without its model: nothing to gather it through."""
    m, o = _fsdp1(0, uop)
    _step(m, o, 0)
    saved = attempt(lambda: tg.save(f"{root}/alone", {"optim": o}))
    tg.save(f"{root}/both", {"model": m, "optim": o})
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in o.state.items()}
    _step(m, o, 1)
    loaded = attempt(lambda: tg.load(f"{root}/both", {"optim": o}, only=["optim"]))
    untouched = all(not torch.equal(v, o.state[p][k]) for p in o.state for k, v in before[id(p)].items() if k != "step")
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # another class: refused, as for plain optimizers
    other = attempt(lambda: tg.load(f"{root}/both", {"model": m, "optim": sgd}))
    return {"saved": saved, "loaded": loaded, "untouched": untouched, "other": other}


@pytest.mark.parametrize("uop", [False, True])
def test_sharded_fsdp1_optimizer_without_its_model_is_refused_before_anything_is_written(tmp_path: Path, uop: bool) -> None:
    """Before: use_orig_params=False saved one rank's flat shard for all (a warning); True was
    refused as ranks that differ, advising split_state=True."""
    for r in run_ranks(_optimizer_alone, 2, str(tmp_path), uop, timeout=90):
        for what in ("saved", "loaded"):
            out = r.value[what]
            assert out["type"] in ("RankFailureError", "UnsupportedValueError"), (what, out)
            last = out["msg"].strip().splitlines()[-1]
            assert "FullyShardedDataParallel (FSDP1)" in last and "'model': fsdp_model" in last and "fully_shard" in last
            assert "split_state" not in last
        assert r.value["untouched"]  # the refused load read nothing into the optimizer
        other = r.value["other"]
        assert other["type"] is not None and "holds the state of an Adam optimizer" in other["msg"], other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both"]


def _whole_optim(m: nn.Module, o: torch.optim.Optimizer) -> dict:
    """The optimizer's state by name, whole on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(m, o, options=StateDictOptions(full_state_dict=True))
    return {k: {n: v.clone() for n, v in st.items()} for k, st in osd["state"].items()}


def _flat_run(rank: int, world: int, root: str, uop: bool) -> dict:
    """FULL_SHARD per Linear: an async save at step 2, training goes on to step 4."""

    m, o = _fsdp1(0, uop)
    state = {"model": m, "optim": o, "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(2), async_save=True) as mgr:
        for s in range(5):
            _step(m, o, s)
            state["progress"]["step"] = s
            if s == 2:
                at2 = {"p": _full(m), "o": _whole_optim(m, o)}
                at2["o"] = {k: {n: v.clone() for n, v in st.items()} for k, st in at2["o"].items()}
            mgr.save(s, state)
        mgr.wait()
    return {"at2": at2, "end": _full(m)}


def _flat_resume(rank: int, world: int, root: str, uop: bool) -> dict:

    m, o = _fsdp1(1, uop)
    state = {"model": m, "optim": o, "progress": tg.StateDict(step=0)}
    before = _full(m)
    got = tg.load(f"{root}/step-000000002", state)
    loaded = {"p": _full(m), "o": _whole_optim(m, o)}
    for s in range(state["progress"]["step"] + 1, 5):
        _step(m, o, s)
    out = {"before": before, "loaded": loaded, "end": _full(m), "shapes": {k: e.shape for k, e in got.tensors.items()}}
    if world == 2:  # migration: into FSDP2 and its optimizer
        from torch.distributed.fsdp import fully_shard

        from dist_helper import full_state

        torch.manual_seed(3)
        two = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
        for layer in (two[0], two[2]):
            fully_shard(layer, mesh=cpu_mesh())
        fully_shard(two, mesh=cpu_mesh())
        opt2 = torch.optim.Adam(two.parameters(), lr=1e-2)
        tg.load(f"{root}/step-000000002", {"model": two, "optim": opt2}, only=["model", "optim"])
        out["fsdp2"] = full_state(two, opt2)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(v, b[k]) if isinstance(v, dict) else torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("uop", [False, True])
def test_sharded_fsdp1_optimizer_resumes_bit_identically_and_reshards(tmp_path: Path, uop: bool) -> None:
    """FULL_SHARD: saved through torch.distributed.checkpoint's get_optimizer_state_dict as whole
    tensors by name (was: use_orig_params=False one rank's flat shard for all, with a warning; True
    refused as ranks that differ, advising split_state=True); resumed on 2 ranks the next steps
    are bit-identical; loads on 3 ranks, into FSDP2 + Adam, and into a plain model + Adam in one process."""
    ref = run_ranks(_flat_run, 2, str(tmp_path), uop, timeout=90)[0].value
    for world in (2, 3):
        for r in run_ranks(_flat_resume, world, str(tmp_path), uop, timeout=90):
            v = r.value
            assert v["shapes"]["optim/state/0.weight/exp_avg"] == [16, 8]  # by name, whole
            assert not _same(v["before"], ref["at2"]["p"])
            assert _same(v["loaded"]["p"], ref["at2"]["p"]) and _same(v["loaded"]["o"], ref["at2"]["o"]), world
            if world == 2:  # on 3 ranks the gradients are averaged over 3: other roundings
                assert _same(v["end"], ref["end"])
                f2 = v["fsdp2"]
                assert _same({k[2:]: t for k, t in f2.items() if k.startswith("p/")}, ref["at2"]["p"])
                assert all(torch.equal(t, ref["at2"]["o"][k.split("/")[1]][k.split("/")[2]])
                           for k, t in f2.items() if k.startswith("o/")) and len(f2) == 4 + 12
    torch.manual_seed(9)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    tg.load(tmp_path / "step-000000002", {"model": plain, "optim": opt}, only=["model", "optim"])
    names = dict(zip((id(p) for p in plain.parameters()), (n for n, _ in plain.named_parameters()), strict=True))
    assert _same({names[id(p)]: dict(s) for p, s in opt.state.items()}, ref["at2"]["o"])
    assert _same(plain.state_dict(), ref["at2"]["p"])


def _state_dict_types(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m, o = _fsdp1(0, True)
    _step(m, o, 0)
    out = {}
    for name, kind, cfg in [("sharded", StateDictType.SHARDED_STATE_DICT, None),
                            ("local", StateDictType.LOCAL_STATE_DICT, None),
                            ("rank0", StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))]:
        with FSDP.state_dict_type(m, kind, cfg):
            out[name] = attempt(lambda n=name: tg.save(f"{root}/{n}", {"model": m}))
    # torch's default (FULL_STATE_DICT on every rank) is saved, and loaded back. (offload_to_cpu=True
    # is not tried: on CPU torch's own state_dict() dies with SIGSEGV in _state_dict_utils.param_hook.)
    ref = _full(m)
    tg.save(f"{root}/full", {"model": m})
    m2, _ = _fsdp1(1, True)
    out["differed"] = any(not torch.equal(a, b) for a, b in zip(ref.values(), _full(m2).values(), strict=True))
    with FSDP.state_dict_type(m2, StateDictType.SHARDED_STATE_DICT):
        out["load_sharded"] = attempt(lambda: tg.load(f"{root}/full", {"model": m2}))
    out["untouched"] = out["differed"] and any(
        not torch.equal(a, b) for a, b in zip(ref.values(), _full(m2).values(), strict=True))
    tg.load(f"{root}/full", {"model": m2})
    out["equal"] = all(torch.equal(a, b) for a, b in zip(ref.values(), _full(m2).values(), strict=True))
    return out


def test_fsdp1_state_dict_type_other_than_full_on_every_rank_is_refused(tmp_path: Path) -> None:
    for r in run_ranks(_state_dict_types, 2, str(tmp_path), timeout=90):
        v = r.value
        for name, kind in [("sharded", "SHARDED_STATE_DICT"), ("local", "LOCAL_STATE_DICT"),
                           ("rank0", "FULL_STATE_DICT with rank0_only=True"), ("load_sharded", "SHARDED_STATE_DICT")]:
            assert v[name]["type"] in ("RankFailureError", "UnsupportedValueError"), (name, v[name])
            assert f"state_dict_type {kind}," in v[name]["msg"] and "FSDP.state_dict_type" in v[name]["msg"], v[name]["msg"]
        assert v["differed"] and v["untouched"] and v["equal"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def _model_alone(rank: int, world: int, root: str) -> dict:
    """The FSDP1 model alone saves full tensors by name: it resumes bit-identically, and loads
    into FSDP2 (a migration) on the same ranks."""
    from torch.distributed.fsdp import fully_shard

    m, o = _fsdp1(0, False)
    for s in range(2):
        _step(m, o, s)
    ref = _full(m)
    man = tg.save(f"{root}/ck", {"model": m, "progress": tg.StateDict(step=2)})
    m2, _ = _fsdp1(3, False)
    differed = any(not torch.equal(a, b) for a, b in zip(ref.values(), _full(m2).values(), strict=True))
    tg.load(f"{root}/ck", {"model": m2}, only=["model"])
    equal = all(torch.equal(a, b) for a, b in zip(ref.values(), _full(m2).values(), strict=True))
    torch.manual_seed(5)
    two = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    for layer in (two[0], two[2]):
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(two, mesh=cpu_mesh())
    tg.load(f"{root}/ck", {"model": two}, only=["model"])
    into_fsdp2 = all(torch.equal(p.full_tensor(), ref[n]) for n, p in two.named_parameters())
    return {"shapes": {k: e.shape for k, e in man.tensors.items()}, "differed": differed, "equal": equal,
            "into_fsdp2": into_fsdp2, "ref": ref}


def test_fsdp1_model_alone_resumes_and_migrates_to_fsdp2_and_plain(tmp_path: Path) -> None:
    res = run_ranks(_model_alone, 2, str(tmp_path), timeout=90)
    ref = res[0].value["ref"]
    for r in res:
        assert r.value["shapes"] == {"model/0.weight": [16, 8], "model/0.bias": [16], "model/2.weight": [5, 16],
                                     "model/2.bias": [5]}  # full tensors by name, no flat parameter
        assert r.value["differed"] and r.value["equal"] and r.value["into_fsdp2"]
    torch.manual_seed(9)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    assert not torch.equal(plain[0].weight, ref["0.weight"])
    tg.load(tmp_path / "ck", {"model": plain}, only=["model"])  # one process: a plain model
    assert all(torch.equal(v, ref[k]) for k, v in plain.state_dict().items())


def _no_shard(rank: int, world: int, root: str, uop: bool, resume: bool) -> list[torch.Tensor]:
    m, o = _fsdp1(0 if not resume else 4, uop, "NO_SHARD")
    state = {"model": m, "optim": o}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(2), async_save=True) as mgr:
        start = mgr.restore(state) if resume else None
        for s in range(0 if start is None else start + 1, 5):
            _step(m, o, s)
            mgr.save(s, state)
            if s == 2 and not resume:
                break
        mgr.wait()
    return [v for v in _full(m).values()]


def test_fsdp1_no_shard_with_optimizer_resumes_bit_identically(tmp_path: Path) -> None:
    """``NO_SHARD``: the optimizer state is whole on every rank and is not refused (async manager)."""
    ref = run_ranks(_no_shard_ref, 2, timeout=90)[0].value
    run_ranks(_no_shard, 2, str(tmp_path), False, False, timeout=90)
    got = run_ranks(_no_shard, 2, str(tmp_path), False, True, timeout=90)
    for r in got:
        assert all(torch.equal(a, b) for a, b in zip(ref, r.value, strict=True))


def _no_shard_ref(rank: int, world: int) -> list[torch.Tensor]:
    m, o = _fsdp1(0, False, "NO_SHARD")
    for s in range(5):
        _step(m, o, s)
    return list(_full(m).values())
