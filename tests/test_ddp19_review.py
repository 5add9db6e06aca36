"""DistributedDataParallel features that carry state, saved and resumed on real gloo ranks
(127.0.0.1): the steps after a resume must equal the run that went on, bit for bit, on every rank."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from test_replicas18_review import _train  # each rank's own data

from dist_helper import run_ranks


def _powersgd(local: bool = False):
    """DDP over one 32x32 weight (its bucket's layout is the same before and after DDP rebuilds its
    buckets: docs/distributed.md) with PowerSGD from step 2, error feedback and warm start."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(32, 32, bias=False))
    hs = P.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(hs, P.powerSGD_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), hs


def _powersgd_rank(rank: int, world: int, root: str, async_: bool) -> dict:
    import logging

    logging.getLogger("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook").setLevel(logging.ERROR)
    a, oa, _ = _powersgd()
    _train(a, oa, range(7), rank, 32)
    out: dict = {}
    for put in (True, False):
        b, ob, hb = _powersgd()
        _train(b, ob, range(4), rank, 32)
        state = {"model": b, "optim": ob, **({"powersgd": hb} if put else {})}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            h = tg.save(f"{root}/{put}/step-000000004", state, async_=async_)
            if async_:
                h.result()
        c, oc, hc = _powersgd()
        tg.load(f"{root}/{put}/step-000000004", {"model": c, "optim": oc, **({"powersgd": hc} if put else {})})
        _train(c, oc, range(4, 7), rank, 32)
        out[put] = {"same": torch.equal(a.module.weight, c.module.weight), "iter": hc.iter,
                    "warned": [str(x.message) for x in w if "communication hook" in str(x.message)]}
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's PowerSGD hook calls torch.cuda.synchronize(device) "
                    "for CPU buckets when CUDA is available (ValueError: expected a cuda device; torch 2.11 on an H200, "
                    "same code in 2.13): a CPU/gloo DDP test cannot run it there")
@pytest.mark.parametrize("async_", [False, True])
def test_powersgd_state_in_the_state_resumes_bit_identically(tmp_path: Path, async_: bool) -> None:
    """``powerSGD_hook``'s state (step counter, error feedback, warm-start P/Q, the generator seeding Q)
    lives outside the module. Before, a ``PowerSGDState`` entry was refused (no pickle) and without it a
    resumed run repeated the warm-up and lost the error feedback: its weights differed from the run that
    went on. Now it is saved (rank-local: each rank's error feedback is its own) and the resume is exact;
    a save of a DDP whose PowerSGD state is not in the state warns, naming the fix."""
    res = run_ranks(_powersgd_rank, 2, str(tmp_path), async_, timeout=90)
    for r in res:
        kept, lost = r.value[True], r.value[False]
        assert kept["same"] and kept["iter"] == 7 and kept["warned"] == [], kept
        assert not lost["same"] and lost["iter"] == 3, lost  # the warm-up again: 2 steps of plain all-reduce
    (msg,) = res[0].value[False]["warned"]
    assert "'model'" in msg and "powerSGD_hook" in msg and "PowerSGDState" in msg and 'state["comm_hook"]' in msg, msg
    assert res[1].value[False]["warned"] == []  # rank 0 warns


def _local_sgd_rank(rank: int, world: int, root: str) -> dict:
    """``post_localSGD_hook`` without gradient all-reduce after step 3: each rank trains on its own
    from then on (model and optimizer rank-local, docs/distributed.md); the hook's ``iter`` decides
    when that starts."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as L

    sub, _ = dist.new_subgroups(group_size=world)

    def build():
        torch.manual_seed(0)
        net = nn.Linear(32, 4)
        ddp = nn.parallel.DistributedDataParallel(net)
        hs = L.PostLocalSGDState(process_group=None, subgroup=sub, start_localSGD_iter=3, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(hs, L.post_localSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp.trainguard_rank_local = opt.trainguard_rank_local = True
        return ddp, opt, hs

    a, oa, _ = build()
    _train(a, oa, range(6), rank, 32)
    b, ob, hb = build()
    _train(b, ob, range(2), rank, 32)
    tg.save(f"{root}/step-000000002", {"model": b, "optim": ob, "hook": hb})
    c, oc, hc = build()
    tg.load(f"{root}/step-000000002", {"model": c, "optim": oc, "hook": hc})
    loaded = hc.iter
    _train(c, oc, range(2, 6), rank, 32)
    return {"same": all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters())), "loaded": loaded}


def test_post_local_sgd_hook_state_iter_survives(tmp_path: Path) -> None:
    res = run_ranks(_local_sgd_rank, 2, str(tmp_path), timeout=90)
    for r in res:
        assert r.value == {"same": True, "loaded": 2}, r.value  # before: refused (no pickle); fresh, iter 0 all-reduced on


def _fp16_rank(rank: int, world: int, root: str) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D

    def build():
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)))
        ddp.register_comm_hook(None, D.fp16_compress_hook)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01)

    a, oa = build()
    _train(a, oa, range(6), rank, 32)
    b, ob = build()
    _train(b, ob, range(3), rank, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stateless hook: nothing to warn about
        tg.save(f"{root}/step-000000003", {"model": b, "optim": ob})
    c, oc = build()
    tg.load(f"{root}/step-000000003", {"model": c, "optim": oc})
    _train(c, oc, range(3, 6), rank, 32)
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_stateless_fp16_compress_hook_resumes_bit_identically(tmp_path: Path) -> None:
    assert [r.value for r in run_ranks(_fp16_rank, 2, str(tmp_path), timeout=90)] == [True, True]


def _three_rank(rank: int, world: int, root: str, unused: bool) -> bool:
    """An MLP under DDP on 3 ranks, AdamW, saved with a CheckpointManager at step 3 and resumed in fresh
    objects: True when the resumed weights equal the uninterrupted run's after step 6."""

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=unused)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01)

    a, oa = build()
    _train(a, oa, range(6), rank, 32)
    b, ob = build()
    _train(b, ob, range(3), rank, 32)
    with tg.CheckpointManager(f"{root}/{unused}", save=tg.EveryNSteps(1)) as mgr:
        mgr.save(3, {"model": b, "optim": ob})
    c, oc = build()
    with tg.CheckpointManager(f"{root}/{unused}", save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore({"model": c, "optim": oc}) == 3
    _train(c, oc, range(3, 6), rank, 32)
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_three_ranks_resume_bit_identically_with_find_unused_parameters(tmp_path: Path) -> None:
    """On 3+ gloo ranks the sum of an all-reduce depends on where an element sits in its bucket; a fresh
    DDP's first step uses its initial buckets, the run that went on its rebuilt ones (docs/distributed.md,
    "DDP's bucket layout"): every weight differed after the resume. find_unused_parameters=True keeps the
    initial layout in both runs, and the resume is exact."""
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("ignore")
        res = run_ranks(_three_rank, 3, str(tmp_path), True, timeout=120)
    assert [r.value for r in res] == [True, True, True]


def _subgroup_rank(rank: int, world: int, root: str) -> dict:
    """4 ranks, DDP over [0, 1] and over [2, 3], each group its own replica (its own seed)."""
    import os

    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = rank // 2

    def build():
        torch.manual_seed(10 + g)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), process_group=groups[g])
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    a, oa = build()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    a(x).square().mean().backward()
    oa.step()
    with pytest.raises(tg.CheckpointError) as refused:
        tg.save(f"{root}/shared/step-000000001", {"model": a, "optim": oa})
    written = os.path.exists(f"{root}/shared/step-000000001")
    names = {f"model{g}": a, f"optim{g}": oa}  # what the message says: each group's own names
    tg.save(f"{root}/named/step-000000001", names, split_state=True)
    c, oc = build()
    with torch.no_grad():
        for p in c.parameters():
            p.add_(1)
    tg.load(f"{root}/named/step-000000001", {f"model{g}": c, f"optim{g}": oc}, split_state=True)
    return {"msg": str(refused.value), "written": written,
            "own": all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))}


def test_ddp_over_a_subgroup_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """Two DDP groups of 2 ranks on a 4-rank world, each training its own replica under the same entry
    name: the shared entry was saved once for all ranks, every rank resumed with group 0's biases and
    group 1's weights (warned only because they already differed at the first save). Refused before
    anything is written, naming the group and the fix; with each group's own names and split_state=True
    every group resumes its own replica."""
    res = run_ranks(_subgroup_rank, 4, str(tmp_path), timeout=120)
    for r in res:
        v = r.value
        assert not v["written"] and v["own"], v
        assert "entry 'model'" in v["msg"] and ("[0, 1]" if r.rank < 2 else "[2, 3]") in v["msg"], v["msg"]
        assert "split_state=True" in v["msg"] and "trainguard_rank_local" in v["msg"], v["msg"]


def _join_rank(rank: int, world: int, root: str, every_step: bool) -> dict:
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen: dict = {"errors": []}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with Join([ddp]):
            for s in range(3 - 2 * rank):  # uneven: rank 0 has 3 batches, rank 1 has 1
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * s + rank)) * (1 + rank)
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
                if s > 0 and not every_step:
                    continue
                try:  # step 0: every rank has a batch, the save succeeds; step 1: rank 1 has joined
                    tg.save(f"{root}/inside/step-{s:09d}", {"model": ddp, "optim": opt}, timeout=4)
                except tg.RankFailureError as e:
                    seen["errors"].append(str(e))
                    return seen  # the ranks' save calls are out of step now (docs/distributed.md)
        if every_step:  # rank 1: its save calls are out of step with rank 0's failed one
            return seen
        tg.save(f"{root}/after/step-000000001", {"model": ddp, "optim": opt})  # after the block: every rank
        seen["warned"] = [str(x.message) for x in w if "Join" in str(x.message)]
    mine = {k: v.clone() for k, v in net.state_dict().items()}
    torch.manual_seed(1)
    back = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    tg.load(f"{root}/after/step-000000001", {"model": back}, only=["model"])
    seen["differ"] = [k for k, v in back.state_dict().items() if not torch.equal(v, mine[k])]
    return seen


def test_a_save_inside_join_that_a_joined_rank_never_reaches_says_why_and_after_it_holds_the_synced_model(
    tmp_path: Path,
) -> None:
    """DDP with uneven inputs under ``Join``: a save inside the context at a step where a rank has
    joined waits for it until the timeout (that rank is in Join's exit). Its error names the Join and
    where to save instead (torch does not mark the block's end, so the save itself cannot tell inside
    from after and must not warn: a save after the block is right). After the block every rank holds
    the model Join synced (from the last joiner), and the checkpoint is that model, buffers included."""
    res = run_ranks(_join_rank, 2, str(tmp_path / "a"), False, timeout=90)
    for r in res:  # a save inside while every rank has a batch, and one after the block
        assert r.value["errors"] == [] and r.value["warned"] == [] and r.value["differ"] == [], r.value
    res = run_ranks(_join_rank, 2, str(tmp_path / "b"), True, timeout=90)  # a save at every step inside
    (msg,) = res[0].value["errors"]
    assert "did not arrive" in msg and "under torch's Join" in msg and "Save after the block" in msg, msg
    assert res[1].value["errors"] == []  # rank 1 joined after step 0's save and never came to step 1's
    assert (tmp_path / "b" / "inside" / "step-000000000").is_dir()
    assert not (tmp_path / "b" / "inside" / "step-000000001").exists()


def _skipped_step_rank(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    found = []
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        for step in (1, 2, 3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step + 10 * rank))
            opt.zero_grad()
            ddp(x).square().mean().backward()
            if not (step == 2 and rank == 1):  # rank 1's optimizer skips step 2 (a rank-dependent skip: a bug)
                opt.step()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                mgr.save(step, {"model": ddp, "optim": opt})
            found.append([str(x.message) for x in w if "differ between ranks" in str(x.message)])
    return {"found": found}


def test_parameters_that_diverge_after_the_first_save_are_caught(tmp_path: Path) -> None:
    """A rank whose optimizer skipped a step holds other parameters and moments from then on. Only the
    first save of a process hashed every replicated tensor, later ones the module buffers alone: the
    divergence at step 2 went unreported and every rank resumed with one rank's copy. Later saves now
    also hash the head of a moving window of 64 replicated tensors (every tensor here at each save)."""
    from trainguard.events import read_events

    res = run_ranks(_skipped_step_rank, 2, str(tmp_path), timeout=90)
    first, second, third = res[0].value["found"]
    assert first == [] and len(second) == 1 and third == [], res[0].value  # warned once per process
    assert "model/0.weight" in second[0] and "ranks 0 | 1" in second[0], second[0]
    assert res[1].value["found"] == [[], [], []]
    ev = {e["step"]: e for e in read_events(tmp_path) if e["event"] == "replicas_differ"}
    assert sorted(ev) == [2, 3], ev  # each later save's finding in the event log
    assert {"model/0.weight", "optim/state/0.weight/exp_avg"} <= {t["tensor"] for t in ev[2]["tensors"]}, ev[2]
