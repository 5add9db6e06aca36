"""Replicated tensors that differ between ranks (replicas.py): each is saved from ONE rank and every
rank resumes with that copy, so the save warns, naming them (2 real gloo ranks on 127.0.0.1)."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.events import read_events

from dist_helper import run_ranks


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _ddp(model: nn.Module, sync_buffers: bool) -> nn.Module:
    if sync_buffers:
        return nn.parallel.DistributedDataParallel(model)
    params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    # torch 2.13 deprecates broadcast_buffers (a FutureWarning) for forward_sync_buffers
    off = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return nn.parallel.DistributedDataParallel(model, **off)


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, width: int = 8) -> None:
    for s in steps:
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * s + rank)) * (1 + rank)  # each rank's own data
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()


def _ours(w: list[warnings.WarningMessage]) -> list[str]:
    """The replicas warnings among ``w``, each as ``category: message``."""
    return [f"{x.category.__name__}: {x.message}" for x in w if "differ between ranks" in str(x.message)]


def _bn_ranks(rank: int, world: int, root: str, sync_buffers: bool) -> dict:
    ddp = _ddp(_bn_model(), sync_buffers)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = {"model": ddp, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    got = []
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        for step in (1, 2):  # the first save hashes every replicated tensor, the second the module buffers
            _train(ddp, opt, range(step - 1, step), rank)
            state["progress"]["step"] = step
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                mgr.save(step, state)
            got.append(_ours(w) if not sync_buffers else [str(x.message) for x in w])
    _train(ddp, opt, range(2, 4), rank)
    straight = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    again = _ddp(_bn_model(), sync_buffers)
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1)
    tg.load(f"{root}/step-000000002", {"model": again, "optim": opt2}, only=["model", "optim"])
    _train(again, opt2, range(2, 4), rank)
    differ = sorted(k for k, v in again.module.state_dict().items() if not torch.equal(v, straight[k]))
    return {"warnings": got, "differ": differ}


def test_unsynced_batchnorm_statistics_warn_naming_them(tmp_path: Path) -> None:
    res = run_ranks(_bn_ranks, 2, str(tmp_path), False, timeout=60)
    first, second = res[0].value["warnings"]
    assert len(first) == 1 and not second, res[0].value  # rank 0 warns, once per process
    msg = first[0]
    assert msg.startswith("ReplicasDifferWarning: ") and issubclass(tg.ReplicasDifferWarning, UserWarning), msg
    assert "model/1.running_mean" in msg and "model/1.running_var" in msg, msg
    assert "num_batches_tracked" not in msg and "model/0.weight" not in msg and "optim" not in msg, msg
    assert "ranks 0 | 1" in msg and "trainguard_rank_local" in msg and "SyncBatchNorm" in msg, msg
    assert res[1].value["warnings"] == [[], []]  # the others send their digests; rank 0 reports
    assert "1.running_mean" in res[0].value["differ"]  # what the warning is about: the resume is a mix
    ev = [e for e in read_events(tmp_path) if e["event"] == "replicas_differ"]
    assert [e["step"] for e in ev] == [1, 2], ev  # each save's finding logged, the later one from the buffers alone
    assert sorted(t["tensor"] for t in ev[1]["tensors"]) == ["model/1.running_mean", "model/1.running_var"]


def test_synced_ddp_batchnorm_resumes_bit_identically_without_warning(tmp_path: Path) -> None:
    """DDP broadcasts rank 0's buffers before each forward; after a step each rank's running stats
    moved by its own batch. The checkpoint keeps rank 0's (the copy the next forward would give every
    rank): the resumed run is the uninterrupted one (it kept another rank's before), and not warned."""
    res = run_ranks(_bn_ranks, 2, str(tmp_path), True, timeout=60)
    for r in res:
        assert r.value["warnings"] == [[], []], r.value  # no warning of any kind
        assert r.value["differ"] == [], r.value  # e.g. ['1.running_mean', '1.running_var'] before
    assert not [e for e in read_events(tmp_path) if e["event"] == "replicas_differ"]


def _param_ranks(rank: int, world: int, root: str, async_: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    out = []
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(rank)  # rank 1's weight differs, the bias is equal
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            h = tg.save(f"{root}/step-{step:09d}", {"model": model}, async_=async_)
            with torch.no_grad():
                model.weight.sub_(rank)  # equal again right after the call: the digest is of the state at the call
            if async_:
                h.result()
        out.append(_ours(w))
    return {"warnings": out}


@pytest.mark.parametrize("async_", [False, True])
def test_parameter_that_differs_on_one_rank_warns_once(tmp_path: Path, async_: bool) -> None:
    res = run_ranks(_param_ranks, 2, str(tmp_path), async_, timeout=60)
    (msg,), again = res[0].value["warnings"]
    assert "model/weight" in msg and "model/bias" not in msg and "ranks 0 | 1" in msg, msg
    assert again == []  # once per process (and a later save hashes module buffers only: a Linear has none)
    assert res[1].value["warnings"] == [[], []]


class _Own(nn.Linear):
    trainguard_rank_local = True


def _excluded_ranks(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(rank)  # every tensor below differs between the ranks
    own = _Own(4, 4)
    stage = nn.ModuleDict({str(rank): nn.Linear(4, 4)})  # pipeline style: each rank its own layer
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.save(f"{root}/local/step-000000001", {"own": own, "rng": tg.RNGState()})
        tg.save(f"{root}/split/step-000000001", {"stage": stage, "own": own}, split_state=True)
    return {"warnings": [str(x.message) for x in w]}


def test_rank_local_entries_and_split_state_groups_are_not_compared(tmp_path: Path) -> None:
    res = run_ranks(_excluded_ranks, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r.value["warnings"] == [], r.value
    whole = nn.ModuleDict({"0": nn.Linear(4, 4), "1": nn.Linear(4, 4)})
    tg.load(tmp_path / "split" / "step-000000001", {"stage": whole}, only=["stage"])
    torch.manual_seed(1)
    _Own(4, 4)
    assert torch.equal(whole["1"].weight, nn.Linear(4, 4).weight)  # each stage's own copy kept


def _split_group_ranks(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    stage = nn.ModuleDict({"a": nn.Linear(4, 4)} if rank < 2 else {"b": nn.Linear(4, 4)})  # ranks 0, 1: one stage
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(rank)  # ranks 0 and 1 (replicas of stage "a") differ; rank 2 is a group of its own
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.save(f"{root}/step-000000001", {"stage": stage}, split_state=True)
    return {"warnings": _ours(w)}


def test_split_state_compares_within_each_group(tmp_path: Path) -> None:
    res = run_ranks(_split_group_ranks, 3, str(tmp_path), timeout=60)
    (msg,) = res[0].value["warnings"]
    assert "stage/a.weight" in msg and "stage/a.bias" in msg and "ranks 0 | 1" in msg and "stage/b" not in msg, msg
    assert res[1].value["warnings"] == [] and res[2].value["warnings"] == []
