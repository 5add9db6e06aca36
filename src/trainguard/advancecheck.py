"""``ResumableSampler``'s check, at ``next_epoch``/``set_epoch``, that ``advance(n)`` counted the
samples the epoch's iterator gave this rank.

The position is what a checkpoint keeps; it moves only by ``advance``. A DataLoader iterator that
read the epoch to its end has had every sample trained on, so the position should then be at the
epoch's end, or short of it by less than one batch (``DataLoader(drop_last=True)`` drops a
partial last batch). Two mistakes leave it short by more, silently, and a resume mid-epoch then
reads again what was trained on:

- ``advance`` never called (a loop converted from ``DistributedSampler``): the position stays
  where the iterator began (warned from the epoch's start only: from a restored position an
  iterator may rightly yield no batch at all);
- ``advance`` called with another count than the samples: ``advance(1)`` each step (batches, not
  samples), ``advance(len(batch))`` of a dict batch (its number of keys: a Hugging Face
  collator's). Seen: 13 of 100 samples counted for a full epoch of batches of 8; a checkpoint
  at step 5 kept position 5 instead of 40.

:func:`note_advance` (``advance``) counts the calls and samples since the iterator began
(``note_iter``, when it yields its first index); :func:`check_advanced` warns once per sampler.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any


def note_iter(sampler: Any) -> list[int]:
    """A sampler iterator's first index: count ``advance`` calls from here. Returns the counts: the
    iterator adds each index it yields to ``[2]``."""
    sampler._advanced = counts = [0, 0, 0, sampler.epoch, sampler._restores]  # calls, samples per rank, yielded
    return counts


def batches_ahead() -> int:
    """``ResumableSampler``'s iterator as it runs out: the batches a multi-process DataLoader iterator
    reading it keeps ahead of the loop (``prefetch_factor * num_workers``), 0 for any other reader.
    Those read the sampler to its end while the loop was that many batches short of it: a loop that
    stopped there (a steps-per-epoch cap) had counted right and was warned about."""
    try:  # torch's private class: a torch without it counts no batches ahead (the check as before)
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    except ImportError:
        return 0
    f: FrameType | None = sys._getframe(1)
    for _ in range(8):  # the sampler's generator, a BatchSampler's, _try_put_index
        if f is None:
            break
        it = f.f_locals.get("self")
        if isinstance(it, _MultiProcessingDataLoaderIter):
            return int(getattr(it, "_prefetch_factor", 0) or 0) * int(getattr(it, "_num_workers", 0) or 0)
        f = f.f_back
    return 0


def note_advance(sampler: Any, n: int) -> None:
    """``advance(n)``: count it; warn (``RuntimeWarning``, once per sampler) when the samples counted
    since the epoch's iterator began pass those it gave this rank (indices a DataLoader's workers
    read ahead count as given: they only make it more). ``advance`` caps the position at the epoch's
    end, so an over-count (the global batch, ``len(x) * world``) reached the end silently mid-epoch:
    a checkpoint then resumed past samples never trained on, and the epoch's last ones were skipped.
    Not after a restore or an epoch change since that iterator began (``advance(n)`` there skips
    data on purpose: a rollback past a loss spike)."""
    if n:
        sampler._batch = n  # the last count: check_reread's batch
    counts = sampler.__dict__.get("_advanced")
    if counts is None:
        return
    counts[0] += 1
    counts[1] += n
    if counts[1] > counts[2] and counts[3:] == [sampler.epoch, sampler._restores] \
            and not sampler.__dict__.get("_warned_over"):
        sampler._warned_over = True
        warnings.warn(f"ResumableSampler: advance() counted {counts[1]} sample(s) in {counts[0]} call(s) since epoch "
                      f"{sampler.epoch}'s iterator began, more than the {counts[2]} it gave this rank: advance(n) takes "
                      "the samples this rank consumed, len(x) of this rank's batch, not the global batch (times the "
                      "world size), else the position passes what was trained on and a checkpoint resumes past "
                      "samples never trained on (the epoch's last ones are skipped) (docs/data.md)",
                      RuntimeWarning, stacklevel=3)


def check_advanced(sampler: Any) -> None:
    """``next_epoch``/``set_epoch`` (before the epoch changes): warn (``RuntimeWarning``, once per
    sampler) when an iterator read this epoch to its end and the position is short of the end by
    a batch or more: by ``advance``'s own mean count times the world size (times one more than the
    batches a DataLoader's worker processes had read ahead of the loop: :func:`batches_ahead`)."""
    began = sampler.__dict__.get("_ran_out")  # (epoch, position, batches ahead) of the iterator that ran out
    if began is None or began[0] != sampler.epoch or sampler.epoch_done or sampler.__dict__.get("_warned_advance"):
        return
    _, world = sampler.rank_world
    calls, samples = (sampler.__dict__.get("_advanced") or (0, 0))[:2]
    if began[1] == 0 == sampler.position:
        what = (f"the position stayed at {sampler.position}: advance(n) was not called, so a checkpoint resumes at that "
                "position and reads the epoch again")
    elif calls and sampler._end(world) - sampler.position >= max(1, samples // calls) * world * (1 + began[2]):
        what = (f"advance() counted {samples} sample(s) in {calls} call(s) (the position went from {began[1]} to "
                f"{sampler.position} of {sampler.num_samples}): advance(n) takes the samples this rank consumed, not 1 "
                "per step nor len() of a dict batch (its number of keys), else a checkpoint mid-epoch resumes at a "
                "position short of what was trained on and reads those samples again")
    else:
        return
    sampler._warned_advance = True
    warnings.warn(f"ResumableSampler: a DataLoader iterator read epoch {sampler.epoch} to its end but {what}. Call "
                  "sampler.advance(len(x)) with x the batch's tensor after each training step (docs/data.md)",
                  RuntimeWarning, stacklevel=4)


def check_reread(sampler: Any) -> None:
    """``ResumableSampler.__iter__`` (every rank, each new iterator): warn (``RuntimeWarning``, once per
    sampler) when the iterator before this one read this epoch to its end, no restore or epoch change since,
    and either all it gave this rank was advanced (nothing is left) or it gave less than a batch (``advance``'s
    last count) and none was advanced (what ``DataLoader(drop_last=True)`` dropped, again). A loop that
    forgets ``set_epoch(epoch)``/``next_epoch()`` (``for epoch in range(E): for x in loader``) trained epoch 0
    and then every further epoch on no data at all, silently (review57h). Not warned: the first iterator
    after a restore at an epoch's end (it rightly yields nothing), nor one after an iterator that stopped
    early (``next(iter(loader))``, a loop that broke: it did not run out, or some of it is left to read)."""
    ran = sampler.__dict__.get("_ran_out")
    if ran is None or len(ran) < 5 or ran is sampler.__dict__.get("_loaded") or sampler.__dict__.get("_warned_reread"):
        return  # restored since it ran out (the same state too: a retry that restored the latest checkpoint)
    epoch, _, _, restores, counts = ran
    if counts is not sampler.__dict__.get("_advanced") or (epoch, restores) != (sampler.epoch, sampler._restores):
        return  # another iterator began since (it did not run out), or the epoch or position was set or restored
    calls, advanced, gave = counts[:3]
    if not gave:  # it began at the epoch's end (after a restore there; HF's replay of the trained epochs): it tells nothing
        return
    if gave > advanced and (calls or gave >= sampler.__dict__.get("_batch", 1)):
        return  # samples left to read (a loop that stopped early: a partial last batch is data too)
    sampler._warned_reread = True
    warnings.warn(f"ResumableSampler: a new iterator reads epoch {sampler.epoch} again from sample {sampler.position} of "
                  f"{sampler.num_samples}, after an iterator read it to its end: it has no batch left to give, and so has "
                  "every further epoch until the epoch changes (set_epoch/next_epoch forgotten?). Call "
                  "sampler.set_epoch(epoch) at the start of each epoch (for epoch in range(sampler.epoch, epochs)), or "
                  "sampler.next_epoch() after it (docs/data.md)", RuntimeWarning, stacklevel=3)
