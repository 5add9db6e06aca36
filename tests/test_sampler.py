"""ResumableSampler: exact coverage over restarts at other world sizes, DataLoader workers."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.errors import CheckpointError
from trainguard.sampler import ResumableIterable, ResumableSampler

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def _consume(
    state: dict | None, world: int, steps: int, batch: int, n: int, epochs: int
) -> tuple[list[int], dict, list[int]]:
    """Run `steps` lockstep steps of `world` ranks from `state`; return indices consumed, the new
    state and the tail padding among them (expected: the epoch's first samples, wrapped)."""
    samplers = [ResumableSampler(n, seed=7, rank=r, world_size=world) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    seen: list[int] = []
    padding: list[int] = []
    for _ in range(steps):
        if samplers[0].epoch >= epochs:
            break
        if samplers[0].epoch_done:
            for s in samplers:
                s.next_epoch()
            continue
        its = [list(s)[:batch] for s in samplers]
        assert len({len(got) for got in its}) == 1  # lockstep: the same batch size on every rank
        left = n - samplers[0].position
        if len(its[0]) * world > left:  # this step ends the epoch and holds the padding
            padding += [samplers[0].order()[i % n] for i in range(len(its[0]) * world - left)]
        for s, got in zip(samplers, its):
            seen += got
            s.advance(len(got))
    return seen, samplers[0].state_dict(), padding


def test_world_size_changes_cover_every_sample_once_per_epoch():
    n, epochs = 120, 2
    seen, pads, state = [], [], None
    # 2 ranks, then 1, then 3, then 2 again until done: the global position carries over.
    for world, steps in ((2, 5), (1, 7), (3, 9), (2, 1000)):
        got, state, padding = _consume(state, world, steps, batch=4, n=n, epochs=epochs)
        seen += got
        pads += padding
    assert state["epoch"] == epochs
    # Once each, plus the padding of epoch 0's tail at W=3 (4 left: 2 per rank, 2 wrapped).
    assert len(pads) == 2
    assert Counter(seen) == Counter({i: epochs for i in range(n)}) + Counter(pads)


def test_order_depends_on_seed_and_epoch_and_load_restores_position():
    a = ResumableSampler(50, seed=1, rank=0, world_size=1)
    assert a.order(0) != a.order(1) and a.order(0) == ResumableSampler(50, seed=1).order(0)
    assert sorted(a.order(3)) == list(range(50))
    a.advance(10)
    b = ResumableSampler(50, seed=99, rank=0, world_size=1)
    assert list(b) != list(a)
    b.load_state_dict(a.state_dict())
    assert list(b) == list(a) == a.order()[10:]
    with pytest.raises(CheckpointError, match="num_samples"):
        ResumableSampler(51).load_state_dict(a.state_dict())


def test_uneven_tail_and_drop_last():
    # Equal counts for lockstep ranks: rank 1's tail wraps around to the epoch's first sample.
    s0, s1 = (ResumableSampler(7, shuffle=False, rank=r, world_size=2) for r in (0, 1))
    assert list(s0) == [0, 2, 4, 6] and list(s1) == [1, 3, 5, 0] and len(s0) == len(s1) == 4
    d0, d1 = (ResumableSampler(7, shuffle=False, drop_last=True, rank=r, world_size=2) for r in (0, 1))
    assert list(d0) == [0, 2, 4] and list(d1) == [1, 3, 5]


def test_dataloader_workers_resume_mid_epoch():
    ds = TensorDataset(torch.arange(40))
    s = ResumableSampler(ds, seed=3, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=4, sampler=s, num_workers=2)
    first = []
    for (x,) in loader:  # workers prefetch ahead; only advance() moves the position
        first += x.tolist()
        s.advance(len(x))
        if len(first) == 12:
            break
    resumed = ResumableSampler(ds, seed=0, rank=0, world_size=1)
    resumed.load_state_dict(s.state_dict())
    rest = [i for (x,) in DataLoader(ds, batch_size=4, sampler=resumed, num_workers=2) for i in x.tolist()]
    assert first + rest == s.order()
    assert sorted(first + rest) == list(range(40))


def test_iterable_wrapper_resumes_at_global_position():
    def stream(epoch):
        return iter(range(20))

    a0, a1 = ResumableIterable(stream, rank=0, world_size=2), ResumableIterable(stream, rank=1, world_size=2)
    got = list(a0)[:3] + list(a1)[:3]
    a0.advance(3)
    b = ResumableIterable(stream, rank=0, world_size=1)
    b.load_state_dict(a0.state_dict())
    assert sorted(got + list(b)) == list(range(20))


def test_doc_example_runs():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {})


def test_a_sampler_state_and_an_iterable_state_are_not_taken_for_each_other():
    """A ResumableSampler's state loaded into a ResumableIterable was accepted (its position, an
    index into a dataset, applied to a stream); the other way round raised a bare KeyError."""
    sampler = ResumableSampler(TensorDataset(torch.arange(10)), rank=0, world_size=1, seed=0)
    stream = ResumableIterable(lambda epoch: iter(range(10)), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="is a ResumableSampler's"):
        stream.load_state_dict(sampler.state_dict())
    with pytest.raises(CheckpointError, match="not a ResumableSampler's"):
        sampler.load_state_dict(stream.state_dict())
    stream.load_state_dict({"epoch": 1, "position": 4})  # its own kind still loads
    assert stream.state_dict() == {"epoch": 1, "position": 4}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_read_without_advance_warns_at_the_next_epoch(num_workers):
    from torch.utils.data import DataLoader

    def run(advance: bool) -> list:
        s = ResumableSampler(12, seed=1, rank=0, world_size=1)
        loader = DataLoader(list(range(12)), batch_size=4, sampler=s, num_workers=num_workers)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _epoch in range(2):  # without advance: warned at the first epoch's end, not again
                for batch in loader:
                    if advance:
                        s.advance(len(batch))
                s.next_epoch() if _epoch == 0 else s.set_epoch(2)
        return [str(w.message) for w in seen if "advance" in str(w.message)]

    assert run(advance=True) == []
    msgs = run(advance=False)
    assert len(msgs) == 1 and "epoch 0" in msgs[0] and "stayed at 0" in msgs[0]
