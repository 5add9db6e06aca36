"""ResumableSampler's uneven epoch tail (drop_last=False): every rank yields the same count, so
lockstep ranks run the same steps per epoch; the tail is padded by wrapping around to the start
of the epoch's order; ``position`` counts real samples, so a resume mid-tail at another world
size continues the uninterrupted order. One test runs 2 real ranks (gloo) with an all-reduce per
step, as DDP does."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from trainguard.sampler import ResumableSampler

from dist_helper import run_ranks

SEED = 5


def _ranks(n: int, world: int, position: int = 0) -> list[ResumableSampler]:
    samplers = [ResumableSampler(n, seed=SEED, rank=r, world_size=world) for r in range(world)]
    state = samplers[0].state_dict() | {"position": position}
    for s in samplers:
        s.load_state_dict(state)
    return samplers


def _batches(sampler: ResumableSampler, batch: int) -> list[list[int]]:
    ds = TensorDataset(torch.arange(sampler.num_samples))
    return [x.tolist() for (x,) in DataLoader(ds, batch_size=batch, sampler=sampler)]


def _interleave(per_rank: list[list[int]]) -> list[int]:
    """The global sequence read by lockstep ranks: round k is rank 0's k-th sample, rank 1's, ..."""
    return [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(len(per_rank))]


def _expected(order: list[int], position: int, world: int) -> list[int]:
    """order[position:] padded to a multiple of ``world`` by wrapping to the epoch's start."""
    rest = order[position:]
    pad = math.ceil(len(rest) / world) * world - len(rest)
    return rest + [order[i % len(order)] for i in range(pad)]


def _run_to_end(samplers: list[ResumableSampler], batch: int) -> list[list[int]]:
    """Every rank iterates its loader; then each applies advance(len(batch)) step by step, as
    the documented loop does. Returns each rank's samples."""
    per_rank = [_batches(s, batch) for s in samplers]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks get different numbers of batches: {[len(b) for b in per_rank]}"
    for step in zip(*per_rank):
        assert len({len(b) for b in step}) == 1, f"batch sizes differ in one step: {step}"
        for s, b in zip(samplers, step):
            s.advance(len(b))
    return [[i for b in bs for i in b] for bs in per_rank]


@pytest.mark.filterwarnings("ignore:ResumableSampler. a new iterator reads epoch:RuntimeWarning")  # list(s) at the end, on purpose
@pytest.mark.parametrize(
    ("n", "world", "batch"),
    [(9, 2, 4), (10, 3, 4), (7, 4, 2), (13, 3, 5), (101, 4, 8), (3, 5, 1), (11, 2, 11)],
)
def test_uneven_tail_gives_every_rank_the_same_count_and_covers_every_index(n, world, batch):
    assert n % world != 0
    order = ResumableSampler(n, seed=SEED).order(0)
    # From the epoch's start and from positions a world-size change can leave.
    for position in sorted({0, 1, n // 3, max(n - world + 1, 0), n - 1}):
        samplers = _ranks(n, world, position)
        per_rank_count = math.ceil((n - position) / world)
        assert [len(s) for s in samplers] == [per_rank_count] * world
        got = _run_to_end(samplers, batch)
        assert [len(g) for g in got] == [per_rank_count] * world
        assert _interleave(got) == _expected(order, position, world)
        assert set(i for g in got for i in g) | set(order[:position]) == set(range(n))
        # Padding is not counted: the position ends at num_samples on every rank.
        assert [s.position for s in samplers] == [n] * world and all(s.epoch_done for s in samplers)
        assert [len(s) for s in samplers] == [0] * world and all(list(s) == [] for s in samplers)


def test_save_mid_tail_at_world_2_resume_at_world_1_and_3():
    n, batch = 13, 2
    order = ResumableSampler(n, seed=SEED).order(0)
    uninterrupted = _interleave(_run_to_end(_ranks(n, 2), batch))
    assert uninterrupted == order + order[:1]  # 7 per rank: one padding sample, order[0]
    for steps in (2, 3):  # W=2 batches are 2, 2, 2, 1: save before the last two or the last one
        w2 = _ranks(n, 2)
        seen: list[int] = []
        for _ in range(steps):
            step = [next(iter(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, sampler=s)))[0].tolist()
                    for s in w2]
            for s, b in zip(w2, step):
                seen += b
                s.advance(len(b))
        saved = w2[0].state_dict()
        assert saved["position"] == 4 * steps and saved["epoch"] == 0 and not w2[0].epoch_done
        assert sorted(seen) == sorted(order[: saved["position"]])
        for world in (1, 3):
            resumed = [ResumableSampler(n, seed=0, rank=r, world_size=world) for r in range(world)]
            for s in resumed:
                s.load_state_dict(saved)
            assert [s.position for s in resumed] == [saved["position"]] * world
            remaining = n - saved["position"]
            assert [len(s) for s in resumed] == [math.ceil(remaining / world)] * world
            got = _interleave(_run_to_end(resumed, batch))
            # The real samples continue the uninterrupted order; padding wraps to the start.
            assert got[:remaining] == order[saved["position"]:] == uninterrupted[saved["position"]:n]
            assert got == _expected(order, saved["position"], world)
            assert Counter(seen + got) == Counter(order) + Counter(got[remaining:])
            assert [s.position for s in resumed] == [n] * world and all(s.epoch_done for s in resumed)
            # The next epoch starts at 0 with equal counts at this world size.
            for s in resumed:
                s.next_epoch()
            assert [s.state_dict()["position"] for s in resumed] == [0] * world
            nxt = _interleave(_run_to_end(resumed, batch))
            assert nxt == _expected(resumed[0].order(1), 0, world)
    # A checkpoint taken after the padded last step resumes as a finished epoch at any size.
    done = _ranks(n, 2)
    _run_to_end(done, batch)
    for world in (1, 3):
        resumed = _ranks(n, world, done[0].state_dict()["position"])
        assert all(s.epoch_done and len(s) == 0 and list(s) == [] for s in resumed)


def lockstep_worker(rank: int, world: int) -> dict:
    """The reviewer's scenario: the documented loop, one all_reduce per step (DDP's gradient
    all-reduce), 9 samples, batch 4, two epochs."""
    ds = TensorDataset(torch.arange(9))
    s = ResumableSampler(ds, seed=0)
    loader = DataLoader(ds, batch_size=4, sampler=s)
    steps, log, seen = 0, [], []
    while s.epoch < 2:
        for (x,) in loader:
            t = torch.tensor([float(s.epoch)])
            dist.all_reduce(t)  # the peers must be on the same step of the same epoch
            assert t.item() == world * s.epoch, (t.item(), s.epoch)
            s.advance(len(x))
            steps += 1
            seen.append((s.epoch, x.tolist()))
            log.append((s.epoch, len(x), s.position))
        s.next_epoch()
    return {"steps": steps, "epoch": s.epoch, "log": log, "seen": seen}


@pytest.mark.timeout(120)
def test_two_ranks_lockstep_all_reduce_through_uneven_tails():
    res = run_ranks(lockstep_worker, 2, timeout=60)
    a, b = (r.value for r in res)
    assert a["steps"] == b["steps"] == 4 and a["epoch"] == b["epoch"] == 2
    assert a["log"] == b["log"] == [(0, 4, 8), (0, 1, 9), (1, 4, 8), (1, 1, 9)]
    for epoch in (0, 1):
        got = [i for v in (a, b) for e, idx in v["seen"] if e == epoch for i in idx]
        assert len(got) == 10 and set(got) == set(range(9))
