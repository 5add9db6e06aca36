"""Several DataLoader workers reading one :class:`trainguard.sampler.ResumableIterable`.

With ``num_workers = K > 1`` torch gives each worker process its own copy of the dataset; each
worker builds batches of the loader's ``batch_size`` from the items its copy yields, and with
``in_order=True`` (the default) the loader hands out the workers' batches round-robin: task
``t`` goes to worker ``t % K`` and the batches come out in task order, a worker whose copy ran
out being skipped (torch/utils/data/dataloader.py, ``_try_put_index`` and ``_next_data``).

So the rank's share of the stream from the current position (the sequence a ``num_workers=0``
loader would batch: every ``W``-th item, the padded or dropped last group included) is cut into
consecutive blocks of ``batch_size`` items, and worker ``w`` yields the items of blocks ``w``,
``w + K``, ``w + 2K``, ...: the loader then yields block 0, 1, 2, ..., the same batches as with
``num_workers`` 0 or 1, in the same order. A worker cannot seek in a generic stream: each reads
the stream from its start, skips the position and the other workers' (and ranks') blocks, so
the stream is read ``K`` times per rank; ``ResumableIterable(transform=...)`` runs only on the
items a worker keeps, which is where several workers gain.

Who calls what: ``ResumableIterable.__iter__`` (in each worker process, once per DataLoader
iterator) calls :func:`check_workers`, then wraps the rank's items in :func:`worker_share`;
``ResumableIterable.__init__`` calls :func:`check_make_iter`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any


def check_make_iter(make_iter: Any) -> None:
    """``ResumableIterable.__init__``: refuse a ``make_iter`` that is not callable (an ``IterableDataset``, a list or
    a generator passed as the stream itself). Before, the first batch raised ``TypeError: 'X' object is not
    callable`` (inside a DataLoader worker, after the workers started), not saying what to pass (review57h)."""
    if not callable(make_iter):
        raise TypeError(
            f"ResumableIterable({make_iter!r:.60}): pass a function of the epoch that opens the stream anew, the same "
            "order every time (e.g. ResumableIterable(lambda epoch: iter(dataset))), not the stream itself: a resume "
            "reads it again from its start to skip what was consumed (docs/data.md)"
        )


def check_workers(batch_size: int | None, num_workers: int) -> None:
    """``ResumableIterable.__iter__`` in a DataLoader worker: refuse ``num_workers > 1`` without
    the loader's batch size (each worker would yield the rank's whole share: every item K times)."""
    if num_workers > 1 and batch_size is None:
        raise ValueError(
            f"ResumableIterable: DataLoader has num_workers={num_workers}; each worker would read the whole "
            "stream and yield every item once per worker. Use num_workers=0 or 1, or pass "
            "ResumableIterable(..., batch_size=<the DataLoader's batch_size>): each worker then yields its "
            "own batches, in the loader's order (docs/data.md)"
        )


def _loader_batch_size() -> int | None:
    """The batch size of the DataLoader fetch that asked for the next item, found in the caller
    frames (torch's ``_IterableDatasetFetcher.fetch(possibly_batched_index)``); ``None`` when
    not recognised (another torch version, a custom fetcher): the check is then skipped."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == "fetch" and "possibly_batched_index" in frame.f_locals:
            if not getattr(frame.f_locals.get("self"), "auto_collation", True):
                return 1  # DataLoader(batch_size=None): one item per task
            index = frame.f_locals["possibly_batched_index"]
            return len(index) if isinstance(index, (list, tuple)) else None
        frame = frame.f_back
    return None


def worker_share(items: Iterable[Any], batch_size: int, worker: int, num_workers: int) -> Iterator[Any]:
    """The items of blocks ``worker``, ``worker + num_workers``, ... of ``items`` (the rank's
    share from the current position, cut into blocks of ``batch_size``), in order. Raises a
    ValueError at the first item when the loader's batch size is recognisably another one (its
    batches would straddle blocks: the order would be wrong)."""
    checked = False
    for m, item in enumerate(items):
        if (m // batch_size) % num_workers != worker:
            continue
        if not checked:
            checked = True
            seen = _loader_batch_size()
            if seen is not None and seen != batch_size:
                raise ValueError(
                    f"ResumableIterable(batch_size={batch_size}) is read by a DataLoader whose batches hold {seen} "
                    f"items (num_workers={num_workers}): they would mix the workers' blocks out of order. Pass "
                    "the DataLoader's batch_size (1 for DataLoader(batch_size=None))"
                )
        yield item
