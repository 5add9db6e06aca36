"""``ResumableIterable``'s check that ``advance(n)`` counted the items its iterator gave this rank:
the same mistakes as ``ResumableSampler``'s (:mod:`trainguard.advancecheck`), warned the same way.

The position is what a checkpoint keeps; it moves only by ``advance``. ``advance(1)`` per batch of
10 (batches, not items) or ``len(batch)`` of a dict batch (its number of keys) under-counts: a
checkpoint mid-epoch resumes short of what was trained on and reads those items again, silently
(seen: 10 of 100 items counted for a full epoch of batches of 10). ``advance(len(x) * world)`` (the
global batch) over-counts: a resume skips items never trained on. ``ResumableSampler`` warned of
both; ``ResumableIterable`` said nothing.

Checked where the iterator runs in this process (``DataLoader(num_workers=0)``, or a plain ``for``
over the dataset): :func:`counted` wraps that iterator's items and counts them. With DataLoader
worker processes the items are read in the workers' copies of the dataset, which this process
never sees: not checked (nothing is warned there). Who calls: ``ResumableIterable.__iter__``
(:func:`counted`), ``advance`` (:func:`note_advance`), ``next_epoch`` (:func:`check_epoch`), each
on its own rank; each warning once per dataset object (``RuntimeWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch


def counted(ds: Any, items: Iterator[Any]) -> Iterator[Any]:
    """``__iter__``'s ``(index, item)`` pairs for this rank, counted from the first one on when read in
    this process (not in a DataLoader worker); the count ends when the stream ends (``_ran_out``)."""
    if torch.utils.data.get_worker_info() is not None:
        yield from items
        return
    check_reread(ds)
    counts = None
    for pair in items:
        if counts is None:  # [advance calls, items they counted, items yielded, epoch, restores, position]
            ds._advanced = counts = [0, 0, 0, ds.epoch, ds._restores, ds.position]
        counts[2] += 1
        yield pair
    if counts is not None:
        ds._ran_out = counts


def check_reread(ds: Any) -> None:
    """:func:`counted`, as an iterator of this process begins: warn once (``RuntimeWarning``) when the iterator
    before it read this epoch's stream to its end, no restore or epoch change since, and either all it gave this
    rank was advanced, or it gave less than a batch (``advance``'s last count) and none was advanced (what
    ``DataLoader(drop_last=True)`` dropped, again): the stream has no batch left from the position. A loop
    that forgets ``next_epoch()`` (``for epoch in range(E): for x in loader``) trained epoch 0 and then every
    further epoch on nothing, silently (review57h)."""
    counts = ds.__dict__.get("_ran_out")
    if counts is not ds.__dict__.get("_advanced") or not _same_epoch(ds, counts) or counts is ds.__dict__.get("_loaded") \
            or ds.__dict__.get("_warned_reread"):
        return  # none ran out, or another iterator gave items since, or the epoch or position was set or restored
    if counts[2] > counts[1] and (counts[0] or counts[2] >= ds.__dict__.get("_batch", 1)):
        return  # items left to read (a loop that stopped early: a partial last batch is data too)
    ds._warned_reread = True
    warnings.warn(f"ResumableIterable: a new iterator reads epoch {ds.epoch}'s stream again from item {ds.position}, "
                  "after an iterator read it to its end: it has no batch left to give, and so has every further epoch "
                  "until the epoch changes (next_epoch forgotten?). Call data.next_epoch() after each epoch's last "
                  "batch (docs/data.md)", RuntimeWarning, stacklevel=4)


def _same_epoch(ds: Any, counts: Any) -> bool:
    """Neither an epoch change nor a restore since the iterator began: its count is the position's."""
    return counts is not None and counts[3:5] == [ds.epoch, ds._restores]


def note_advance(ds: Any, n: int) -> None:
    """``advance(n)``: count it; warn when the items counted since the iterator began pass those it gave
    this rank (``advance(len(x) * world)``). Not after a restore or an epoch change since that iterator
    began, nor before any iterator (an ``advance(n)`` there skips data on purpose)."""
    if n:
        ds._batch = n  # the last count: check_reread's batch
    counts = ds.__dict__.get("_advanced")
    if not _same_epoch(ds, counts):
        return
    counts[0] += 1
    counts[1] += n
    if counts[1] > counts[2] and not ds.__dict__.get("_warned_over"):
        ds._warned_over = True
        warnings.warn(f"ResumableIterable: advance() counted {counts[1]} item(s) in {counts[0]} call(s) since epoch "
                      f"{ds.epoch}'s iterator began, more than the {counts[2]} it gave this rank: advance(n) takes the "
                      "items this rank consumed, len(x) of this rank's batch, not the global batch (times the world "
                      "size), else a checkpoint resumes past items never trained on (docs/data.md)",
                      RuntimeWarning, stacklevel=3)


def check_epoch(ds: Any) -> None:
    """``next_epoch`` (before the epoch changes): warn when an iterator of this process read the epoch's
    stream to its end and ``advance`` counted fewer of its items by a batch or more (``advance``'s own
    mean count; the DataLoader's ``drop_last=True`` drops less than one)."""
    counts = ds.__dict__.get("_ran_out")
    if not _same_epoch(ds, counts) or ds.__dict__.get("_warned_advance"):
        return
    calls, got, gave = counts[:3]
    if gave - got < max(1, got // calls if calls else 1):
        return
    ds._warned_advance = True
    what = ("advance(n) was not called" if not calls else
            f"advance() counted {got} item(s) in {calls} call(s): advance(n) takes the items this rank consumed, not 1 "
            "per step nor len() of a dict batch (its number of keys)")
    warnings.warn(f"ResumableIterable: an iterator read epoch {ds.epoch}'s stream to its end and gave this rank {gave} "
                  f"item(s) from position {counts[5]}, but {what}: a checkpoint mid-epoch resumes at a position "
                  "short of what was trained on and reads those items again. Call data.advance(len(x)) with x "
                  "the batch's tensor after each training step (docs/data.md)", RuntimeWarning, stacklevel=3)
