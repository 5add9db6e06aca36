"""A rank that leaves a trainguard call midway and goes on (its caller caught a Ctrl-C raised
inside it, the ``except KeyboardInterrupt: ...`` pattern) must not leave the ranks' collective
rounds apart for good: the other ranks fail *that* call at once, naming the rank, and the next
call pairs every rank again (``dist.StoreDistContext.operation``, ``distwait.py``).

Before: rank 1's Ctrl-C while writing its data file of a sync save made it skip the save's
"written" and "commit" rounds; rank 0 waited there (until ``TRAINGUARD_TIMEOUT``, or met rank 1's
next save one round off and failed it too), and from then on each rank's rounds were numbered one
apart: every later save waited in its first round until the timeout (600 s by default). An async
save whose rank 1 was interrupted before any round paired rank 1's *next* save with the others'
interrupted one.
"""

from __future__ import annotations

import torch

import trainguard as tg
from test_syscall_review import Inject

from dist_helper import attempt, run_ranks
from dist_helper import small_model as _model

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def _state(seed: int) -> dict:
    return {"model": _model("ddp", seed), "progress": tg.StateDict(step=seed)}


def _same(root: str, name: str, seed: int) -> bool:
    got, want = _state(99), _state(seed)
    tg.load(f"{root}/{name}", got)
    return all(torch.equal(a, b) for a, b in zip(got["model"].state_dict().values(), want["model"].state_dict().values(), strict=True)) \
        and got["progress"]["step"] == seed


def _interrupted(rank: int, fn) -> dict:  # noqa: ANN001
    """Rank 1 runs ``fn`` with a Ctrl-C at the open of its data file and catches it; rank 0 plainly."""
    if rank != 1:
        return attempt(fn)
    try:
        with Inject({"open": 1}, KeyboardInterrupt, match="/data-") as inj:
            fn()
    except KeyboardInterrupt:
        return {"type": "KeyboardInterrupt", "hits": inj.hits}
    return {"type": None, "hits": inj.hits}


def _direct_saves(rank: int, world: int, root: str) -> dict:
    out = {"first": _interrupted(rank, lambda: tg.save(f"{root}/a", _state(1), timeout=30))}
    # Rank 1 goes straight on to its next save; rank 0 gets there once its first save failed.
    out["second"] = attempt(lambda: tg.save(f"{root}/b", _state(2), timeout=30))
    out["loads"] = _same(root, "b", 2)
    return out


def test_a_rank_that_caught_a_ctrl_c_inside_a_save_meets_the_others_at_the_next_save(tmp_path):
    res = run_ranks(_direct_saves, 2, str(tmp_path), timeout=90, env=ENV)
    first = [r.value["first"] for r in res]
    assert first[1] == {"type": "KeyboardInterrupt", "hits": ["open"]}, first
    assert first[0]["type"] == "RankFailureError" and first[0]["ranks"] == [1], first
    assert "left this trainguard call" in first[0]["msg"], first
    # Before: rank 1's second save was failed by rank 0's first ("called different operations").
    assert [r.value["second"] for r in res] == [{"type": None}] * 2, [r.value for r in res]
    assert [r.value["loads"] for r in res] == [True, True]
    assert not (tmp_path / "a").exists()


def _managed(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20).open()
    out = {"first": _interrupted(rank, lambda: mgr.save(1, _state(1)))}
    dist.barrier()  # rank 1 waits for rank 0 outside trainguard (a training step's all-reduce)
    out["second"] = attempt(lambda: mgr.save(2, _state(2)))
    out["close"] = attempt(mgr.close)
    with tg.CheckpointManager(root, handle_signals=False, timeout=20) as again:
        st = _state(99)
        out["restored"] = again.restore(st)
    out["loads"] = _same(root, "step-000000002", 2)
    return out


def test_a_rank_that_caught_a_ctrl_c_inside_a_managed_save_does_not_hold_the_others_until_the_timeout(tmp_path):
    # Before: rank 0 waited in "written" until the manager's 20 s timeout while rank 1 waited for
    # it in a barrier; then the ranks' rounds stayed apart and the next save failed too.
    res = run_ranks(_managed, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["first"]["type"] == "KeyboardInterrupt", vals
    assert vals[0]["first"]["type"] == "RankFailureError" and "left this trainguard call" in vals[0]["first"]["msg"], vals
    assert "did not finish" not in vals[0]["first"]["msg"], vals  # not the timeout's verdict
    assert [(v["second"], v["close"]) for v in vals] == [({"type": None}, {"type": None})] * 2, vals
    assert [(v["restored"], v["loads"]) for v in vals] == [(2, True)] * 2, vals


def _async_saves(rank: int, world: int, root: str) -> dict:
    import trainguard.async_save as asv

    real = asv.copy_into

    def ctrl_c(*a):  # noqa: ANN002, ANN202 - Ctrl-C in the call's copies, before this rank ran any round
        asv.copy_into = real
        raise KeyboardInterrupt

    out: dict = {}
    if rank == 1:
        asv.copy_into = ctrl_c
        try:
            tg.save(f"{root}/a", _state(1), async_=True, timeout=30)
            out["first"] = {"type": None}
        except KeyboardInterrupt:
            out["first"] = {"type": "KeyboardInterrupt"}
    else:
        out["first"] = attempt(lambda: tg.save(f"{root}/a", _state(1), async_=True, timeout=30).result())
    out["second"] = attempt(lambda: tg.save(f"{root}/b", _state(2), async_=True, timeout=30).result())
    out["loads"] = _same(root, "b", 2)
    return out


def test_an_async_save_interrupted_on_one_rank_before_its_rounds_is_not_paired_with_its_next_one(tmp_path):
    # Before: rank 1's second save joined the rounds of rank 0's first one (a save of two calls).
    res = run_ranks(_async_saves, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["first"] == {"type": "KeyboardInterrupt"}, vals
    assert vals[0]["first"]["type"] == "RankFailureError" and vals[0]["first"]["ranks"] == [1], vals
    assert [v["second"] for v in vals] == [{"type": None}] * 2, vals
    assert [v["loads"] for v in vals] == [True, True]
    assert not (tmp_path / "a").exists()
