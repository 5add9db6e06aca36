"""Review (data17): the data position across restarts and world-size changes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import trainguard as tg
from trainguard.sampler import ResumableIterable, ResumableSampler

from dist_helper import attempt, run_ranks


def _nine(epoch: int):
    """A module-level stream (a spawned worker must unpickle it): 9 items per epoch."""
    return iter(range(100 * epoch, 100 * epoch + 9))


def spawned_worker_ranks(rank: int, world: int, context: str) -> list[int]:
    """Rank and world size from torch.distributed, the stream read in one DataLoader worker
    started with ``multiprocessing_context=context``."""
    it = ResumableIterable(_nine)
    loader = DataLoader(it, batch_size=2, num_workers=1, multiprocessing_context=context)
    return [x for b in loader for x in b.tolist()]


@pytest.mark.timeout(120)
def test_iterable_in_a_spawned_worker_keeps_the_process_group_rank():
    # A spawn (or forkserver: Python 3.14's default on Linux) worker has no process group; before
    # the fix it read the stream as rank 0 of 1 on every rank: each rank yielded all 9 items.
    a, b = (r.value for r in run_ranks(spawned_worker_ranks, 2, "spawn", timeout=90))
    assert a == [0, 2, 4, 6, 8] and b == [1, 3, 5, 7, 8], (a, b)


def test_doctor_warns_about_a_loader_that_hands_out_batches_out_of_order():
    # DataLoader(in_order=False): batches come out as workers finish them, while advance(n)
    # records a prefix of the sampler's order as consumed (reproduced: uninterrupted
    # [[2, 3], [6, 7], [0, 1], ...], saved after [2, 3] at position 2, resumed reading [2, 3, 4, ...]:
    # 2 and 3 twice, 0 and 1 never). Before the fix the doctor said nothing about it.
    from trainguard.doctor import Settings, check

    def order(src: str) -> list:
        return [f for f in check({}, Settings(source=src)) if f.check == "data order"]

    (f,) = order("loader = DataLoader(ds, sampler=s, num_workers=4, in_order=False)\n")
    assert f.severity == "warning" and "line 1" in f.message and "in_order=True" in f.fix
    assert order("loader = DataLoader(ds, sampler=s, in_order=True)\n") == []
    assert order("loader = DataLoader(ds, sampler=s)\n") == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_under_a_live_loader_iterator_is_refused_and_a_new_iterator_resumes(tmp_path, workers):
    # A rollback inside the loop (mgr.restore(state, step=N), docs/checkpoints.md) moved the
    # sampler's position back, but the live DataLoader iterator kept yielding from the old place:
    # reproduced with 16 samples, batch 2: rolled back to position 4 after reading [8, 9], the loop
    # went on with [10, 11] while advance() counted from 4; the checkpoint of the next step said 6.
    s = ResumableSampler(32, seed=5, rank=0, world_size=1)
    loader = DataLoader(range(32), batch_size=2, sampler=s, num_workers=workers, generator=torch.Generator())
    it = iter(loader)
    for step in range(1, 6):
        s.advance(len(next(it)))
        if step == 2:
            tg.save(str(tmp_path / "step-2"), {"data": s})
    tg.load(str(tmp_path / "step-2"), {"data": s})  # back to position 4
    with pytest.raises(RuntimeError, match="restored while a DataLoader iterator"):
        next(it)
    del it
    assert next(iter(loader)).tolist() == s.order()[4:6]  # a new iterator: the restored position
    # A load that leaves the position where it is (a restore before any batch) keeps the iterator.
    fresh = iter(loader)
    first = next(fresh)
    tg.load(str(tmp_path / "step-2"), {"data": s})
    assert first.tolist() == s.order()[4:6] and next(fresh).tolist() == s.order()[6:8]


def test_a_rollback_after_the_last_batch_is_refused_where_the_loop_would_end_the_epoch(tmp_path):
    # Without the check the exhausted iterator ended the loop, next_epoch() followed, and the
    # rest of the epoch from the restored position was never read.
    s = ResumableSampler(8, rank=0, world_size=1)
    tg.save(str(tmp_path / "start"), {"data": s})
    it = iter(DataLoader(range(8), batch_size=2, sampler=s))
    for _ in range(4):
        s.advance(len(next(it)))
    tg.load(str(tmp_path / "start"), {"data": s})
    with pytest.raises(RuntimeError, match="restored while a DataLoader iterator"):
        next(it)


def test_an_iterable_restored_under_its_live_iterator_is_refused():
    # num_workers=0: before the fix the generator went on from where it was (the rollback's
    # position was ignored until the next epoch) while advance() counted from the restored one.
    it = ResumableIterable(_nine, rank=0, world_size=1)
    live = iter(DataLoader(it, batch_size=2))
    for _ in range(3):
        it.advance(len(next(live)))
    it.load_state_dict({"epoch": 0, "position": 2})
    with pytest.raises(RuntimeError, match="restored while a DataLoader iterator"):
        next(live)
    assert [x for b in DataLoader(it, batch_size=2) for x in b.tolist()] == list(range(2, 9))
    # A load that keeps the position keeps the iterator.
    again = iter(DataLoader(it, batch_size=2))
    assert next(again).tolist() == [2, 3]
    it.load_state_dict({"epoch": 0, "position": 2})
    assert next(again).tolist() == [4, 5]


def diverged_save(rank: int, world: int, path: str) -> dict:
    """Rank 1 misses one advance() (a step it skipped, or advance() under ``if rank == 0``)."""
    s = ResumableSampler(40, seed=1)
    for step in range(3):
        if not (rank == 1 and step == 1):
            s.advance(2)
    return {"save": attempt(lambda: tg.save(path, {"data": s})), "position": s.position}


@pytest.mark.timeout(120)
def test_a_save_refuses_sampler_positions_that_differ_between_ranks(tmp_path):
    # Before the fix the save succeeded on both ranks and recorded rank 0's position (12) as the
    # position of every rank, though rank 1 had read from 8 (its next batches overlap rank 0's):
    # the divergence was silent, in the run and in every resume.
    a, b = (r.value for r in run_ranks(diverged_save, 2, str(tmp_path / "step-3"), timeout=90))
    assert (a["position"], b["position"]) == (12, 8)
    for got in (a["save"], b["save"]):
        assert got["type"] == "RankFailureError" and got["ranks"] == [1], got
        assert "'data'" in got["msg"] and "advance" in got["msg"], got["msg"]


def stage_save(rank: int, world: int, path: str, reader: int) -> dict:
    """Only rank ``reader`` reads batches (the first stage of a pipeline); the other rank holds
    the same sampler in its state and never iterates nor advances it (a middle stage)."""
    s = ResumableSampler(40, seed=1)
    if rank == reader:
        for batch in torch.utils.data.DataLoader(list(range(40)), batch_size=2, sampler=s):
            s.advance(len(batch))
            if s.position >= 12:
                break
    return {"save": attempt(lambda: tg.save(path, {"data": s})), "position": s.position}


@pytest.mark.timeout(120)
def test_a_rank_that_never_reads_its_sampler_is_not_compared_unless_it_is_rank_0(tmp_path):
    a, b = (r.value for r in run_ranks(stage_save, 2, str(tmp_path / "step-1"), 0, timeout=90))
    assert (a["position"], b["position"]) == (12, 0) and a["save"] == b["save"] == {"type": None}, (a, b)
    restored = ResumableSampler(40, seed=0, rank=0, world_size=2)
    tg.load(tmp_path / "step-1", {"data": restored})
    assert (restored.seed, restored.position) == (1, 12)  # the reading rank's
    # Rank 0 never read, rank 1 did: the checkpoint would keep rank 0's stale position.
    a, b = (r.value for r in run_ranks(stage_save, 2, str(tmp_path / "step-2"), 1, timeout=90))
    for got in (a["save"], b["save"]):
        assert got["type"] == "RankFailureError" and got["ranks"] == [1], got
