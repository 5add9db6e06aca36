"""Review57h: hostile review of the data position on resume (ResumableSampler, ResumableIterable).

Found: a loop that forgets ``set_epoch(epoch)``/``next_epoch()`` (``for epoch in range(E): for x in
loader``) trained epoch 0 and then ran every further epoch on no data at all, silently (the position
stays at the epoch's end; a DistributedSampler loop with the same mistake repeats epoch 0's order).
Now the second pass over an epoch read to its end warns. The rest checks the promise end to end with
real gloo groups, DataLoader workers, persistent workers and prefetch, world sizes 2 -> 3 -> 1 and
3 -> 2, batch sizes changing at each resume, saves mid-epoch, at an epoch's last batch and at the
next epoch's first batch: the consumed global sequence against an uninterrupted run's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

from dist_helper import run_ranks

N, SEED = 23, 5  # 23: divisible by no world size times batch used here


def _reread_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "forgotten?" in str(w.message)]


@pytest.mark.parametrize(("workers", "drop_last"), [(0, False), (0, True), (2, False)])
def test_an_epoch_loop_without_set_epoch_is_warned_at_its_second_epoch(workers, drop_last):
    # Before: epochs 1 and 2 yielded nothing and nothing was said (10 samples, batch 3: [..10 samples], [], []).
    ds = TensorDataset(torch.arange(10))
    s = tg.ResumableSampler(ds, seed=0, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=3, sampler=s, num_workers=workers, drop_last=drop_last)
    per_epoch = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # set_epoch forgotten
            per_epoch.append([i for (x,) in loader for i in x.tolist() if s.advance(len(x)) is None])
    assert [len(p) for p in per_epoch] == [9 if drop_last else 10, 0, 0]
    (msg,) = _reread_warnings(caught)
    assert "set_epoch(epoch)" in msg and "epoch 0" in msg


def test_an_iterable_loop_without_next_epoch_is_warned_at_its_second_epoch():
    data = tg.ResumableIterable(lambda e: iter(range(100 * e, 100 * e + 10)), rank=0, world_size=1)
    loader = DataLoader(data, batch_size=3, drop_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_epoch = [[i for x in loader for i in x.tolist() if data.advance(len(x)) is None] for _ in range(3)]
    assert per_epoch == [list(range(9)), [], []]
    (msg,) = _reread_warnings(caught)
    assert "next_epoch()" in msg


@pytest.mark.parametrize("stream", [range(10), [1, 2, 3], iter(range(3))])
def test_an_iterable_given_the_stream_itself_is_refused_saying_what_to_pass(stream):
    # Before: built, then the first batch raised "'range' object is not callable" (in a worker with num_workers > 0).
    with pytest.raises(TypeError, match=r"lambda epoch: iter\(dataset\)"):
        tg.ResumableIterable(stream)
    assert list(tg.ResumableIterable(lambda epoch: iter([7]), rank=0, world_size=1)) == [7]  # the function: read


def test_right_loops_and_second_passes_with_data_left_are_not_warned(tmp_path):
    ds = TensorDataset(torch.arange(10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = tg.ResumableSampler(ds, seed=0, rank=0, world_size=1)
        loader = DataLoader(ds, batch_size=3, sampler=s, num_workers=2)
        next(iter(loader))  # a peek (shapes): the workers read the whole small epoch ahead, nothing advanced
        for epoch in range(s.epoch, 2):
            s.set_epoch(epoch)
            for (x,) in loader:
                s.advance(len(x))
                if (epoch, s.position) == (0, 6):
                    tg.save(tmp_path / "mid", {"data": s})
            if epoch == 0:
                tg.save(tmp_path / "end", {"data": s})  # the last batch of epoch 0
        for ckpt in ("mid", "end"):  # resumed: mid-epoch, and at the epoch's end (its first pass yields nothing)
            r = tg.ResumableSampler(ds, seed=0, rank=0, world_size=1)
            tg.load(tmp_path / ckpt, {"data": r})
            seen = []
            while r.epoch < 2:
                for (x,) in DataLoader(ds, batch_size=4, sampler=r):
                    seen += x.tolist()
                    r.advance(len(x))
                r.next_epoch()
            assert seen == (r.order(0)[6:] if ckpt == "mid" else []) + r.order(1), ckpt
        b = tg.ResumableSampler(ds, seed=0, rank=0, world_size=1)  # a loop that breaks before the partial last batch
        loader = DataLoader(ds, batch_size=3, sampler=b, num_workers=2, prefetch_factor=2)  # the workers read all 4
        for i, (x,) in enumerate(loader):
            b.advance(len(x))
            if i == 2:
                break
        assert [x.tolist() for (x,) in loader] == [b.order()[9:]]  # the rest, read again after the break: data
        v = tg.ResumableSampler(ds, seed=0, rank=0, world_size=1)  # a validation sampler, never advanced
        for _ in range(3):
            assert len([x for (x,) in DataLoader(ds, batch_size=5, sampler=v)]) == 2
    assert _reread_warnings(caught) == []


# ---- real gloo groups: world sizes and batch sizes change at each resume --------------------------


def train_part(rank: int, world: int, load: str | None, save: str, batch: int, save_at: int, epochs: int) -> list:
    """One run of a rank: resume from ``load``, train with 2 persistent, prefetching DataLoader workers
    and save at its ``save_at``-th step, then stop (what the workers read ahead is dropped); -1: to the end."""
    sampler = tg.ResumableSampler(N, seed=SEED)  # rank and world size from the process group
    loader = DataLoader(TensorDataset(torch.arange(N)), batch_size=batch, sampler=sampler, num_workers=2,
                        persistent_workers=True, prefetch_factor=2, generator=torch.Generator(),
                        multiprocessing_context="fork")  # run_ranks' ranks default to forkserver: seconds a worker
    state = {"data": sampler}
    if load:
        tg.load(load, state)
    seen, steps = [], 0
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            seen.append((epoch, x.tolist()))
            sampler.advance(len(x))
            steps += 1
            if steps == save_at:
                tg.save(save, state)
                return seen
    return seen


def _global(results: list) -> list[tuple[int, int]]:
    """The ranks' batches of one run as the global sequence: step by step, sample j of every rank in
    rank order (rank r's j-th sample is global position p + r + j * W)."""
    per_rank = [r.value for r in results]
    assert len({len(p) for p in per_rank}) == 1, "ranks ran different numbers of steps"
    out = []
    for step in zip(*per_rank):
        assert len({(e, len(b)) for e, b in step}) == 1, step
        out += [(step[0][0], b[1][j]) for j in range(len(step[0][1])) for b in step]
    return out


def _uninterrupted(epoch: int) -> list[int]:
    """Epoch ``epoch`` of an uninterrupted one-process run (batch 7, no workers): the reference order."""
    s = tg.ResumableSampler(N, seed=SEED, rank=0, world_size=1)
    s.set_epoch(epoch)
    return [i for (x,) in DataLoader(TensorDataset(torch.arange(N)), batch_size=7, sampler=s) for i in x.tolist()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("chain", [
    # (world, batch, save at step): 2 -> 3 -> 1: mid-epoch 0 (position 12), then epoch 0's last batch
    # (position 23: the 3 ranks' 24 samples hold one padding duplicate), then to the end at world 1.
    [(2, 3, 2), (3, 2, 2), (1, 4, -1)],
    # 3 -> 2: the first batch of epoch 1 (epoch 0 is 4 steps of 2 at world 3), then to the end.
    [(3, 2, 5), (2, 5, -1)],
])
def test_world_and_batch_size_changes_continue_the_uninterrupted_order(tmp_path, chain):
    seq: list[tuple[int, int]] = []
    load = None
    for i, (world, batch, save_at) in enumerate(chain):
        save = str(tmp_path / f"part{i}")
        seq += _global(run_ranks(train_part, world, load, save, batch, save_at, 2, timeout=120))
        load = save
    for epoch in range(2):
        got, ref = [i for e, i in seq if e == epoch], _uninterrupted(epoch)
        assert sorted(ref) == list(range(N))
        # every sample once, in the uninterrupted order; at most W - 1 padding duplicates at the end,
        # which wrap to the epoch's first samples
        assert got[:N] == ref and got[N:] == ref[: len(got) - N] and len(got) - N < 3, (epoch, got, ref)
