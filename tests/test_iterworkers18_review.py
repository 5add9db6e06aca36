"""Review (iterworkers18): ``ResumableIterable`` read by several DataLoader workers.

With ``batch_size=`` (the loader's) worker ``w`` of ``K`` yields blocks ``w, w + K, ...`` of the
rank's share cut into blocks of ``batch_size``; the loader hands the workers' batches out
round-robin, so it yields the same batches as ``num_workers=0``, and a resume at another
``num_workers`` or world size continues the uninterrupted run's stream exactly. Before the
change ``num_workers > 1`` was refused outright. Expected batches are computed here from the
stream directly (not with the wrapper), so a wrong block-to-worker map fails them.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

# numpy.random imported here, not lazily by each forked DataLoader worker's np.random.seed: a worker
# died twice in ~17 runs of this file (session 19) with KeyError in importlib's module lock while
# importing it, Python 3.11's nested-import race after a fork (not reproduced in 12 runs since).
import numpy.random  # noqa: F401
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import trainguard as tg
from trainguard.sampler import ResumableIterable

from dist_helper import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.usefixtures("loader_workers_ended")]  # conftest: their refusals' iterators, collected
DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def _stream(epoch: int, n: int = 23):
    """A module-level stream of ``n`` items per epoch, distinct across epochs."""
    return iter(range(100 * epoch, 100 * epoch + n))


def _make(n: int) -> functools.partial:
    """``make_iter`` for ``n`` items; picklable: the ranks' DataLoader workers start by forkserver."""
    return functools.partial(_stream, n=n)


def _expected(n: int, rank: int, world: int, batch: int, position: int = 0, epoch: int = 0,
              drop_last: bool = False, loader_drop_last: bool = False) -> list[list[int]]:
    """The rank's batches from ``position``: item ``rank`` of each group of ``world``, a partial
    last group wrapped (or dropped), cut into batches of ``batch``."""
    items = list(range(100 * epoch, 100 * epoch + n))[position:]
    full, k = len(items) // world * world, len(items) % world
    mine = items[rank:full:world]
    if k and not drop_last:
        mine.append(items[full + rank % k])
    out = [mine[i:i + batch] for i in range(0, len(mine), batch)]
    return [b for b in out if len(b) == batch] if loader_drop_last else out


# Workers are forked: the start method is not what these tests check (spawn/forkserver workers: test_data17_review),
# and a forkserver default left by other tests in the same pytest process re-imports torch per worker (seconds each).
FORK = {"multiprocessing_context": "fork"}


def _batches(it: ResumableIterable, batch: int, workers: int, **kw) -> list[list[int]]:
    return [b.tolist() for b in DataLoader(it, batch_size=batch, num_workers=workers, **(FORK if workers else {}), **kw)]


@pytest.mark.parametrize(("workers", "n", "world", "batch", "position"), [
    (2, 23, 1, 4, 0),   # 6 blocks, the last partial
    (3, 24, 1, 4, 0),   # the epoch divides: 6 full blocks, 2 per worker
    (3, 23, 2, 3, 5),   # rank 1 of 2 from an odd position: a partial last group wrapped
    (3, 10, 3, 2, 1),   # 3 items a rank: fewer blocks than workers, one worker yields nothing
])
def test_several_workers_yield_the_batches_of_the_main_process(workers, n, world, batch, position):
    rank = world - 1
    it = ResumableIterable(_make(n), rank=rank, world_size=world, batch_size=batch)
    it.load_state_dict({"epoch": 0, "position": position})
    want = _expected(n, rank, world, batch, position)
    assert _batches(it, batch, workers) == want
    assert _batches(it, batch, 0) == want  # and num_workers=0 (unchanged) agrees


def test_drop_last_of_the_wrapper_and_of_the_loader_with_workers():
    # 2 ranks, 23 items: the wrapper drops the partial last group (item 22), the loader drops
    # the partial last batch; both ranks still yield the same number of batches.
    got = []
    for rank in range(2):
        it = ResumableIterable(_make(23), rank=rank, world_size=2, batch_size=4, drop_last=True)
        got.append(_batches(it, 4, 2, drop_last=True))
        assert got[-1] == _expected(23, rank, 2, 4, drop_last=True, loader_drop_last=True)
    assert [len(g) for g in got] == [2, 2]


def _run(it: ResumableIterable, batch: int, workers: int, stop: int | None = None) -> list[list[int]]:
    """The training loop: each batch consumed is advanced; ``stop``: leave after that many."""
    seen = []
    for b in DataLoader(it, batch_size=batch, num_workers=workers, **(FORK if workers else {})):
        seen.append(b.tolist())
        it.advance(len(b))
        if len(seen) == stop:
            break
    return seen


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 0)])
def test_a_resume_mid_epoch_at_another_num_workers_continues_the_uninterrupted_run(tmp_path, before, after):
    n, batch = 23, 4
    straight = _run(ResumableIterable(_make(n), rank=0, world_size=1, batch_size=batch), batch, 0)
    assert straight == _expected(n, 0, 1, batch)
    it = ResumableIterable(_make(n), rank=0, world_size=1, batch_size=batch)
    first = _run(it, batch, before, stop=2)
    tg.save(str(tmp_path / "step-2"), {"data": it})
    resumed = ResumableIterable(_make(n), rank=0, world_size=1, batch_size=batch)
    tg.load(str(tmp_path / "step-2"), {"data": resumed})
    assert resumed.position == 8
    rest = _run(resumed, batch, after)
    assert first + rest == straight
    resumed.next_epoch()  # the next epoch, again with workers: a fresh copy in each
    assert _run(resumed, batch, before) == _expected(n, 0, 1, batch, epoch=1)


def test_refusals_without_or_with_a_wrong_batch_size_and_with_persistent_workers():
    with pytest.raises(ValueError, match="batch_size"):
        ResumableIterable(_make(5), batch_size=0)
    it = ResumableIterable(_make(12), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"num_workers=2.*batch_size=<the DataLoader's batch_size>"):
        _batches(it, 3, 2)
    it = ResumableIterable(_make(12), rank=0, world_size=1, batch_size=3)
    with pytest.raises(ValueError, match="batches hold 2 items"):  # the loader's batch_size differs
        _batches(it, 2, 2)
    loader = DataLoader(it, batch_size=3, num_workers=2, persistent_workers=True, **FORK)
    assert [b.tolist() for b in loader] == _expected(12, 0, 1, 3)
    it.advance(12)
    it.next_epoch()
    with pytest.raises(ValueError, match="persistent_workers=True"):
        list(loader)


def test_transform_runs_on_the_kept_items_only():
    # Each worker applies transform to its own blocks: the decoded values come out in order,
    # and the transform is never given the other rank's items (checked in the worker).
    def decode(i: int) -> int:
        assert i % 2 == 1, f"rank 1 of 2 was asked to decode item {i}"
        return i * 10

    it = ResumableIterable(_make(12), rank=1, world_size=2, batch_size=2, transform=decode)
    assert _batches(it, 2, 2) == [[10, 30], [50, 70], [90, 110]]
    with pytest.raises(AssertionError, match="decode item 0"):  # the check above can fail
        _batches(ResumableIterable(_make(12), rank=0, world_size=2, batch_size=2, transform=decode), 2, 2)


def stream_ranks(rank: int, world: int, path: str, steps: int) -> dict:
    """2 gloo ranks, 2 DataLoader workers each: the documented loop with an all_reduce per step
    (DDP's), a checkpoint after ``steps`` steps, then on to the end of the epoch. Forked workers
    keep the test fast (forkserver ones take seconds each here); the spawn/forkserver rank of a
    worker is tested in tests/test_data17_review.py."""
    it = ResumableIterable(_make(23), batch_size=3)
    seen = []
    for b in DataLoader(it, batch_size=3, num_workers=2, multiprocessing_context="fork"):
        t = torch.tensor([1.0])
        dist.all_reduce(t)  # every rank must be on a step: the same count of batches everywhere
        seen.append(b.tolist())
        it.advance(len(b))
        if len(seen) == steps:
            tg.save(path, {"data": it})
    return {"seen": seen, "position": it.position}


def resumed_ranks(rank: int, world: int, path: str) -> list[list[int]]:
    """``world`` gloo ranks restored from the 2-rank checkpoint, 3 DataLoader workers each."""
    it = ResumableIterable(_make(23), batch_size=2)
    tg.load(path, {"data": it})
    return [b.tolist() for b in DataLoader(it, batch_size=2, num_workers=3, multiprocessing_context="fork")]


def _global(per_rank: list[list[list[int]]]) -> list[int]:
    """The global stream order the ranks consumed: step by step, item j of every rank in turn."""
    out = []
    for step in zip(*per_rank, strict=True):
        for j in range(len(step[0])):
            out += [b[j] for b in step]
    return out


@pytest.mark.timeout(180)
def test_two_ranks_with_workers_resume_at_world_sizes_1_and_3(tmp_path):
    ckpt = str(tmp_path / "step-2")
    a, b = (r.value for r in run_ranks(stream_ranks, 2, ckpt, 2, timeout=120))
    # Uninterrupted: 23 items over 2 ranks, 12 each (item 22 twice), batches 3, 3, 3, 3.
    assert a["seen"] == _expected(23, 0, 2, 3) and b["seen"] == _expected(23, 1, 2, 3)
    straight = _global([a["seen"], b["seen"]])[:23]
    assert straight == list(range(23))
    # The checkpoint after 2 steps: 2 * 3 items by each of 2 ranks.
    probe = ResumableIterable(_make(23), rank=0, world_size=1)
    tg.load(ckpt, {"data": probe})
    assert probe.position == 12
    ranks3 = [r.value for r in run_ranks(resumed_ranks, 3, ckpt, timeout=120)]
    assert [len(r) for r in ranks3] == [2, 2, 2]  # 11 items left: 4 a rank (one padded), batches 2, 2
    assert _global(ranks3)[: 23 - 12] == straight[12:]
    one = ResumableIterable(_make(23), rank=0, world_size=1, batch_size=2)
    tg.load(ckpt, {"data": one})
    got = _batches(one, 2, 2)
    assert [x for bt in got for x in bt] == straight[12:] and got == _expected(23, 0, 1, 2, 12)


def _doc_example() -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "ResumableIterable(" in b]
    return block


def test_the_documented_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_example(), "docs/data.md", "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "ckpts").exists()
