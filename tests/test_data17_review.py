"""Review (data17): the data position across restarts and world-size changes."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from trainguard.sampler import ResumableIterable

from dist_helper import run_ranks


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
