"""Async save on 2 real ranks (gloo, 127.0.0.1): the background commit runs through the store
while training runs DDP collectives; a disk error on one rank and a rank that dies both surface
as CheckpointError at the next wait() on the surviving ranks, the previous checkpoint stays valid,
buffers are released and no save thread is left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from trainguard.stage import default_pool

from dist_helper import run_ranks


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}


def _step(state: dict, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randn(4, 8, generator=g)
    state["optim"].zero_grad()
    state["model"](x).pow(2).mean().backward()  # DDP all-reduce on the training group
    state["optim"].step()


def _copy(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].module.state_dict().items()}


def _threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("trainguard-async-save")]


def disk_error_on_rank1(rank: int, world: int, root: str) -> dict:
    state = _setup()
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    _step(state, 1, rank)
    mgr.save(1, state)
    _step(state, 2, rank)  # collectives while save 1 commits through the store
    mgr.save(2, state)
    at_2 = _copy(state)
    _step(state, 3, rank)
    mgr.wait()
    os.environ.update(TRAINGUARD_CRASH_AT="write_begin", TRAINGUARD_CRASH_RANK="1", TRAINGUARD_CRASH_KIND="raise")
    mgr.save(3, state)
    _step(state, 4, rank)
    err = None
    try:
        mgr.wait()
    except tg.CheckpointError as e:
        err = f"{type(e).__name__}: {e}"
    del os.environ["TRAINGUARD_CRASH_AT"]
    out = {
        "err": err, "threads": _threads_left(), "pool_in_use": default_pool().in_use, "latest": mgr.latest_step(),
    }
    fresh = _setup(seed=5)
    tg.load(Path(root) / "step-000000002", fresh)
    out["step2_matches"] = all(torch.equal(at_2[k], v) for k, v in fresh["model"].module.state_dict().items())
    mgr.save(5, state)  # saving works again afterwards
    mgr.close()
    out["latest_after"] = mgr.latest_step()
    return out


def test_disk_error_on_one_rank_surfaces_on_every_rank(tmp_path):
    results = run_ranks(disk_error_on_rank1, 2, str(tmp_path / "run"), timeout=120)
    for r in results:
        v = r.value
        assert v["err"] is not None and "RankFailureError" in v["err"] and "injected failure" in v["err"], v["err"]
        assert "rank(s) [1]" in v["err"]
        assert v["threads"] == [] and not v["pool_in_use"]
        assert v["latest"] == 2 and v["step2_matches"]
        assert v["latest_after"] == 5


def rank1_dies(rank: int, world: int, root: str) -> dict:
    state = _setup()
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False, timeout=60).open()
    _step(state, 1, rank)
    mgr.save(1, state)
    mgr.wait()
    if rank == 1:
        os.environ.update(TRAINGUARD_CRASH_AT="write_begin", TRAINGUARD_CRASH_KIND="exit")
    mgr.save(2, state)  # rank 1 exits inside its save thread
    err = None
    try:
        mgr.wait()
    except tg.CheckpointError as e:
        err = f"{type(e).__name__}: {e}"
    out = {"err": err, "threads": _threads_left(), "pool_in_use": default_pool().in_use, "latest": mgr.latest_step()}
    mgr.close()  # the failure was reported by wait(); close() has nothing left to raise
    return out


def test_dead_rank_surfaces_on_the_survivor(tmp_path):
    results = run_ranks(rank1_dies, 2, str(tmp_path / "run"), timeout=120, env={"TRAINGUARD_DEAD_AFTER": "2"},
                        check=False)
    assert results[1].exitcode == 17  # the injected os._exit
    v = results[0].value
    assert results[0].ok, results[0].error
    assert v["err"] is not None and "RankFailureError" in v["err"] and "[1]" in v["err"], v["err"]
    assert v["threads"] == [] and not v["pool_in_use"]
    assert v["latest"] == 1


def _big_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 1024), nn.ReLU(), nn.Linear(1024, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}


def _all_tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.detach().clone() for k, v in state["model"].module.state_dict().items()}
    for i, s in enumerate(state["optim"].state.values()):
        out.update({f"o/{i}/{k}": v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def staged_share(rank: int, world: int, root: str) -> dict:
    state = _big_setup()
    _step(state, 1, rank)
    protected = sum(p.nbytes for p in state["model"].parameters())
    protected += sum(v.nbytes for s in state["optim"].state.values() for v in s.values() if isinstance(v, torch.Tensor))
    out: dict = {"protected": protected}
    for name, cap in (("uncapped", None), ("capped", 1 << 20), ("live", None), ("background", None)):
        os.environ["TRAINGUARD_ASYNC_ZERO_COPY"] = "1" if name == "live" else "0"
        at_call = _all_tensors(state)
        h = tg.save(Path(root) / name, state, async_=True, max_staging_bytes=cap, stage_in_background=name == "background")
        _step(state, 2, rank)  # DDP all-reduce while the save stages and commits through the store
        manifest = h.result(timeout=60)
        mine = f"data-{rank:05d}.bin"
        share = sum(c.length for path, e in manifest.tensors.items() if not path.startswith("rng")
                    for c in e.chunks if c.file == mine)  # the parameter/optimizer bytes this rank wrote
        after = _all_tensors(state)
        fresh = _big_setup(seed=7)
        _step(fresh, 1, rank)  # create Adam state to load into
        before_load = _all_tensors(fresh)
        tg.load(Path(root) / name, fresh)
        loaded = _all_tensors(fresh)
        out[name] = {
            "background": h.staged_background_bytes + h.written_live_bytes, "share": share, "sync": h.staged_sync_bytes, "batches": h.staging_batches,
            "differs_before": any(not torch.equal(before_load[k], at_call[k]) for k in at_call),
            "stepped": any(not torch.equal(after[k], at_call[k]) for k in at_call),
            "equal": loaded.keys() == at_call.keys() and all(torch.equal(loaded[k], at_call[k]) for k in at_call),
        }
    return out


def test_each_rank_stages_only_its_share_of_replicated_state(tmp_path):
    results = run_ranks(staged_share, 2, str(tmp_path / "run"), timeout=120)
    protected = results[0].value["protected"]
    assert protected > 2 << 20
    for name in ("uncapped", "capped", "live", "background"):
        per_rank = [r.value[name] for r in results]
        # Every byte of the parameters and Adam state is staged (or, "live", written from the
        # tensors) exactly once, on the rank that writes it.
        assert sum(v["share"] for v in per_rank) == protected, (name, per_rank)
        assert all(v["share"] < 0.7 * protected for v in per_rank), (name, per_rank)
        if name == "background":  # stage_in_background: nothing in the call, the RNG state too later
            assert all(v["sync"] == 0 and 0 < v["background"] - v["share"] < 64 << 10 for v in per_rank), per_rank
        else:
            assert all(v["background"] == v["share"] for v in per_rank), (name, per_rank)
            assert all(v["sync"] < 64 << 10 for v in per_rank)  # RNG state only
        for v in per_rank:
            assert v["differs_before"] and v["stepped"] and v["equal"], (name, v)
    assert all(r.value["capped"]["batches"] >= 2 for r in results)
    assert all(r.value["uncapped"]["batches"] == 1 for r in results)
