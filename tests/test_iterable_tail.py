"""ResumableIterable's uneven stream end: every rank yields the same count (the partial last
group wrapped within itself), so lockstep ranks run the same steps; ``drop_last`` skips it; a
resume at another world size continues the stream where all ranks together stopped; several
DataLoader workers are refused (each would read the whole stream). One test runs 2 real ranks
(gloo) with an all-reduce per step, as DDP does: before the fix rank 0 waited in an all-reduce
rank 1 never joined."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainguard.errors import CorruptCheckpointError
from trainguard.sampler import ResumableIterable

from dist_helper import run_ranks

pytestmark = pytest.mark.usefixtures("loader_workers_ended")  # conftest: their refusals' iterators, collected


def _stream(n: int):
    return lambda epoch: iter(range(100 * epoch, 100 * epoch + n))


def _ranks(n: int, world: int, position: int = 0, drop_last: bool = False) -> list[ResumableIterable]:
    its = [ResumableIterable(_stream(n), rank=r, world_size=world, drop_last=drop_last) for r in range(world)]
    for it in its:
        it.load_state_dict({"epoch": 0, "position": position})
    return its


def _lockstep(its: list[ResumableIterable], batch: int) -> list[list[int]]:
    """Every rank iterates a DataLoader; the steps must pair up; each rank advances per step."""
    per_rank = [[b.tolist() for b in DataLoader(it, batch_size=batch)] for it in its]
    assert len({len(b) for b in per_rank}) == 1, f"ranks run different step counts: {[len(b) for b in per_rank]}"
    for step in zip(*per_rank):
        assert len({len(b) for b in step}) == 1, f"batch sizes differ in one step: {step}"
        for it, b in zip(its, step):
            it.advance(len(b))
    return [[i for b in bs for i in b] for bs in per_rank]


@pytest.mark.parametrize(("n", "world", "batch"), [(10, 3, 2), (9, 2, 4), (7, 4, 1), (3, 5, 2), (13, 3, 5)])
def test_uneven_end_gives_every_rank_the_same_count(n, world, batch):
    got = _lockstep(_ranks(n, world), batch)
    per_rank = -(-n // world)
    assert [len(g) for g in got] == [per_rank] * world
    # Round k: rank r holds item k*W + r; the partial last group of k items is wrapped.
    full, k = n // world * world, n % world
    for r in range(world):
        assert got[r][: n // world] == list(range(r, full, world))
        if k:
            assert got[r][-1] == full + r % k
    assert set(i for g in got for i in g) == set(range(n))


@pytest.mark.parametrize(("n", "world"), [(10, 3), (9, 2), (3, 5)])
def test_drop_last_skips_the_partial_group(n, world):
    got = _lockstep(_ranks(n, world, drop_last=True), 1)
    assert [len(g) for g in got] == [n // world] * world
    assert sorted(i for g in got for i in g) == list(range(n // world * world))


def test_resume_at_another_world_size_continues_the_stream():
    n = 23
    w2 = _ranks(n, 2)
    loaders = [iter(DataLoader(it, batch_size=3)) for it in w2]
    seen: list[int] = []
    for _ in range(2):  # two lockstep steps of 3 items per rank
        for it, ld in zip(w2, loaders):
            b = next(ld).tolist()
            seen += b
            it.advance(len(b))
    saved = w2[0].state_dict()
    assert saved == {"epoch": 0, "position": 12} and sorted(seen) == list(range(12))
    for world in (1, 3):
        resumed = [ResumableIterable(_stream(n), rank=r, world_size=world) for r in range(world)]
        for it in resumed:
            it.load_state_dict(saved)
        got = _lockstep(resumed, 2)
        real = sorted(set(i for g in got for i in g))
        assert real == list(range(12, n)), "the resumed ranks must read exactly the items not yet consumed"
        assert [len(g) for g in got] == [-(-(n - 12) // world)] * world
        # A checkpoint after the padded end resumes with nothing left, on every rank.
        after = resumed[0].state_dict()
        assert after["position"] >= n
        for it in _ranks(n, 2, after["position"]):
            assert list(it) == []
        for it in resumed:
            it.next_epoch()
        assert [list(it)[0] for it in resumed] == [100 + r for r in range(world)]


def test_several_workers_are_refused_one_worker_matches_the_main_process():
    it = ResumableIterable(_stream(10), rank=0, world_size=1)
    with pytest.raises(ValueError, match="num_workers=2.*Use num_workers=0 or 1"):
        list(DataLoader(it, batch_size=2, num_workers=2))
    one = [x for b in DataLoader(it, batch_size=3, num_workers=1) for x in b.tolist()]
    assert one == list(range(10)) == [x for b in DataLoader(it, batch_size=3) for x in b.tolist()]


def test_a_persistent_worker_is_refused_instead_of_replaying_its_first_epoch():
    # persistent_workers=True keeps the worker's copy of the dataset across epochs: advance(),
    # next_epoch() and load_state_dict() in the main process never reach it. Before the fix the
    # second epoch silently replayed the first epoch's stream (and a resume's skip).
    def make_iter(epoch):
        return iter(range(100 * epoch, 100 * epoch + 6))

    it = ResumableIterable(make_iter, rank=0, world_size=1)
    loader = DataLoader(it, batch_size=2, num_workers=1, persistent_workers=True)
    first = [x for b in loader for x in b.tolist()]
    assert first == list(range(6))
    it.advance(len(first))
    it.next_epoch()
    with pytest.raises(ValueError, match="persistent_workers=True"):
        list(loader)
    # Without persistent workers every epoch's iterator gets a fresh copy: epoch 1 is read.
    again = ResumableIterable(make_iter, rank=0, world_size=1)
    again.next_epoch()
    plain = DataLoader(again, batch_size=2, num_workers=1)
    assert [x for b in plain for x in b.tolist()] == list(range(100, 106))
    assert [x for b in plain for x in b.tolist()] == list(range(100, 106))  # a second iterator too


def test_a_negative_saved_position_is_corrupt():
    it = ResumableIterable(_stream(5), rank=0, world_size=1)
    with pytest.raises(CorruptCheckpointError, match="negative"):
        it.load_state_dict({"epoch": 0, "position": -4})
    assert it.position == 0


def lockstep_worker(rank: int, world: int) -> dict:
    """The documented loop over a stream of 9 items, batch 2, one all_reduce per step (DDP's
    gradient all-reduce), two epochs."""
    it = ResumableIterable(lambda epoch: iter(range(9)))
    loader = DataLoader(it, batch_size=2)
    steps, seen = 0, []
    while it.epoch < 2:
        for x in loader:
            t = torch.tensor([float(it.epoch)])
            dist.all_reduce(t)  # the peers must be on the same step of the same epoch
            assert t.item() == world * it.epoch, (t.item(), it.epoch)
            it.advance(len(x))
            seen += x.tolist()
            steps += 1
        it.next_epoch()
    return {"steps": steps, "seen": seen}


@pytest.mark.timeout(120)
def test_two_ranks_lockstep_all_reduce_through_an_uneven_stream_end():
    a, b = (r.value for r in run_ranks(lockstep_worker, 2, timeout=60))
    # 9 items over 2 ranks: 5 each per epoch (item 8 twice), batches 2, 2, 1 per epoch.
    assert a["steps"] == b["steps"] == 6
    assert a["seen"] == [0, 2, 4, 6, 8] * 2 and b["seen"] == [1, 3, 5, 7, 8] * 2
