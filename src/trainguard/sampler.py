"""``ResumableSampler``: a data order that survives restarts and world-size changes.

The order of epoch ``e`` is a permutation of ``range(num_samples)`` drawn from ``(seed, e)``
(or the identity without shuffling). The position is kept in *global* samples: how many
samples of this epoch all ranks together have consumed. Rank ``r`` of ``W`` reads the global
order from the position with stride ``W`` (``order[pos + r], order[pos + r + W], ...``), so
``W`` ranks that each consumed ``k`` samples consumed exactly ``order[pos : pos + k * W]``.
After a restart at another world size every rank continues from the same global position, and
over a run every sample of each epoch is consumed at least once (exactly once but for the
tail padding below), in the order an uninterrupted run would have had.

Who calls what, on every rank and in this order::

    sampler = tg.ResumableSampler(dataset, seed=0)      # rank/world from torch.distributed
    loader = DataLoader(dataset, batch_size=b, sampler=sampler, num_workers=2,
                        generator=torch.Generator())      # not the global RNG (docs/data.md)
    state["data"] = sampler                               # saved with the checkpoint (global)
    start = mgr.restore(state)
    while sampler.epoch < epochs:
        for x, y in loader:                               # iterates from the saved position
            train_step(x, y)
            sampler.advance(len(x))                       # samples THIS rank consumed
            mgr.save(step, state)
        sampler.next_epoch()

DataLoader workers and prefetching do not matter: the sampler yields indices in the main
process and the position moves only in :meth:`advance`, i.e. when training consumed data.
Every rank yields the same number of samples from a position, so every rank runs the same
number of steps per epoch (DDP's collectives pair up; unequal counts would leave a rank waiting
in an all-reduce its peers never join). When the ``R = num_samples - position`` remaining
samples do not divide by ``W``, the epoch is padded like torch's ``DistributedSampler``: the
global order is extended past its end by wrapping around to the epoch's beginning
(``order[0], order[1], ...``), so each rank gets ``ceil(R / W)`` samples and up to ``W - 1``
samples of the epoch are seen twice. The position counts *real* samples only (``advance`` caps
it at ``num_samples``), so a resume at any world size stays exact. ``drop_last=True`` instead
gives each rank ``R // W`` samples and skips the last ``R % W`` of the epoch.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, SupportsIndex

import torch

from . import iteradvance, iterworkers
from .advancecheck import batches_ahead, check_advanced, check_reread, note_advance, note_iter
from .errors import CheckpointError, CorruptCheckpointError, nonneg_int, whole
from .permanent import check_flags, mark
from .seeded import EpochKey, seed_int, seeded_stream

_END = object()  # the end of a sampler iterator's indices (ResumableSampler._until_restored)


def _rank_world(rank: SupportsIndex | None, world_size: SupportsIndex | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    r, w = whole(0 if rank is None else rank), whole(1 if world_size is None else world_size)  # numpy's, a 0-d tensor's: an int
    if type(r) is not int or type(w) is not int or not 0 <= r < w:  # a numpy rank made the position numpy's: not saved
        raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need integers 0 <= rank < world_size")
    return r, w


def _has_group() -> bool:
    """Whether this process has a torch.distributed process group (a forked worker has its parent's)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()  # imported by torch


def _consumed(n: Any) -> int:
    """``advance(n)``'s count: an int >= 0 (a negative count would move the position back)."""
    return nonneg_int(n, f"advance({n!r}): pass the number of items this rank consumed, an int >= 0 (e.g. len(batch))")


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Sampler for map-style datasets with a global, resumable position (see module doc).

    ``data``: a sized dataset or the number of samples. ``rank``/``world_size`` default to
    torch.distributed's (read at each ``__iter__``, so a restart at another size just works).

    From global position ``p`` with ``R = num_samples - p`` samples left, each rank yields
    ``ceil(R / W)`` samples (``R // W`` with ``drop_last=True``): the same count on every rank,
    so lockstep data parallelism runs the same number of steps everywhere. Without
    ``drop_last`` an uneven tail is padded by wrapping around to the start of the epoch's order
    (as ``DistributedSampler`` does); :meth:`advance` counts only the ``R`` real samples.

    ``with_epoch=True`` yields ``(index, epoch)`` pairs instead of indices, for
    :class:`trainguard.SeededDataset` (random augmentation that a resume reproduces).
    """

    _restores = 0  # load_state_dict calls that moved the position (per instance once one did)
    reads_data = False  # set once iterated or advanced here: capture.check_data_positions compares it

    def __init__(self, data: Sized | SupportsIndex, *, seed: SupportsIndex = 0, shuffle: bool = True, drop_last: bool = False,
                 rank: SupportsIndex | None = None, world_size: SupportsIndex | None = None, with_epoch: bool = False) -> None:
        check_flags(shuffle=shuffle, drop_last=drop_last, with_epoch=with_epoch)  # shuffle="no" was taken as True
        try:  # numpy's int too; None or a float: said so, not len()'s "object of type 'float' has no len()"
            self.num_samples = len(data) if isinstance(data, Sized) and getattr(data, "ndim", 1) else operator.index(data)  # type: ignore[arg-type]  # a 0-d tensor's int too
        except TypeError:
            raise TypeError(f"ResumableSampler({data!r:.80}): pass the dataset (with a len()) or its number of samples, an int") from None
        self.with_epoch = bool(with_epoch)  # yield (index, epoch) pairs, for tg.SeededDataset
        if self.num_samples < 1:
            raise ValueError("ResumableSampler: the dataset is empty")
        self.seed = seed_int(seed, "ResumableSampler")
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        if rank is not None and world_size is not None:
            _rank_world(rank, world_size)  # both given: a wrong pair fails here, not at the first __iter__
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.position = 0  # global samples of this epoch consumed

    @property
    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)`` now: the explicit values, else torch.distributed's."""
        return _rank_world(self._rank, self._world)

    def order(self, epoch: int | None = None) -> list[int]:
        """The global sample order of ``epoch`` (default: the current one)."""
        perm = self._permutation(self.epoch if epoch is None else epoch)
        return list(range(self.num_samples)) if perm is None else perm.tolist()

    def _permutation(self, e: int) -> torch.Tensor | None:
        """Epoch ``e``'s shuffled order as a tensor (8 bytes a sample; ``tolist()`` would make it
        ~36); None without shuffling (the identity). ``order`` and ``__iter__`` call it."""
        if not self.shuffle:
            return None
        key = self.seed * 1_000_003 + e
        if not -(2**63) <= key < 2**64:  # a 64-bit seed (torch.initial_seed()): past what manual_seed takes
            key %= 2**64  # only keys that raised before are mapped: every order that existed stays
        g = torch.Generator()
        g.manual_seed(key)
        return torch.randperm(self.num_samples, generator=g)

    def _end(self, world: int) -> int:
        """The global position at which the epoch's data ends for this world size."""
        if not self.drop_last:
            return self.num_samples
        return self.position + (self.num_samples - self.position) // world * world

    def _per_rank(self, world: int) -> int:
        """Samples every rank yields from the current position (the same on all ranks)."""
        remaining = max(self.num_samples - self.position, 0)
        return remaining // world if self.drop_last else -(-remaining // world)

    def __iter__(self) -> Iterator[Any]:
        self.reads_data = True  # this rank reads data (capture.check_data_positions compares it)
        check_reread(self)  # an epoch read to its end, iterated again: set_epoch/next_epoch forgotten (advancecheck.py)
        # Only this rank's share of the order becomes Python ints (1/W of the epoch): the whole
        # order as a list costs ~36 bytes a sample on every rank (36 GB for 10**9 samples).
        rank, world = self.rank_world
        perm, n, epoch = self._permutation(self.epoch), self.num_samples, self.epoch
        start, stop = self.position + rank, self.position + self._per_rank(world) * world
        end = max(start, min(stop, n))
        mine: Iterable[int] = range(start, end, world) if perm is None else perm[start:end:world].tolist()
        # Global indices past the end wrap to the epoch's beginning: the tail padding (< W in all).
        first_pad = start + len(mine) * world  # type: ignore[arg-type]  # a range or a list
        pad = [(g - n) % n for g in range(first_pad, stop, world)]
        out: Iterator[Any] = itertools.chain(mine, pad if perm is None else perm[pad].tolist())
        if self.with_epoch:  # the key of tg.SeededDataset: its random draws depend on (seed, epoch, index)
            out = (EpochKey((i, epoch)) for i in out)  # a clear error inside a ConcatDataset/Subset
        return self._until_restored(out, self._restores, (epoch, self.position))

    def _until_restored(self, out: Iterator[Any], restores: int, began: tuple[int, int] = (-1, -1)) -> Iterator[Any]:
        """``__iter__``'s indices, refused once :meth:`load_state_dict` moved the position under them
        (a rollback with ``mgr.restore(state, step=N)`` inside the loop): they continue the old
        position, and every later ``advance`` and checkpoint would count from the restored one."""
        counts = note_iter(self)  # advance()'s calls from here, and the indices yielded: advancecheck.py
        for x in itertools.chain(out, [_END]):  # checked at the end too: the loop would end the epoch
            if self._restores != restores:
                raise RuntimeError(
                    "ResumableSampler: its state was restored while a DataLoader iterator was reading it; that "
                    "iterator continues from the position before the restore. Leave the loop and iterate the "
                    "loader again: the new iterator starts at the restored position (docs/data.md)"
                )
            if x is _END:
                self._ran_out = (*began, batches_ahead(), restores, counts)  # _check_advanced, check_reread
                return
            counts[2] += 1
            yield x

    def _check_advanced(self) -> None:
        """``next_epoch``/``set_epoch``: warn when advance() did not count the epoch's samples (advancecheck.py)."""
        check_advanced(self)

    def __len__(self) -> int:
        return self._per_rank(self.rank_world[1])

    def advance(self, n: SupportsIndex) -> None:
        """Record that *this rank* consumed ``n`` more samples; every rank calls it with the same
        ``n`` (lockstep data parallelism), so the global position moves by ``n * world_size``,
        capped at ``num_samples``: tail padding is not counted as consumed data."""
        _, world = self.rank_world
        self.position, self.reads_data = min(self.position + (k := _consumed(n)) * world, self.num_samples), True
        note_advance(self, k)

    @property
    def epoch_done(self) -> bool:
        """Whether this epoch's data is consumed (every rank gets the same answer)."""
        _, world = self.rank_world
        return self.position >= self._end(world)

    def next_epoch(self) -> None:
        """Start the next epoch at position 0."""
        self._check_advanced()
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: SupportsIndex) -> None:
        """DistributedSampler-compatible: a new epoch starts at 0; the current one (e.g. the
        restored one) keeps its position."""
        if int(epoch) < 0:
            raise ValueError(f"set_epoch({epoch!r}): epochs count from 0")
        if epoch < self.epoch:  # a loop `for epoch in range(E)` restarted from 0 after a restore: epochs again
            warnings.warn(f"ResumableSampler.set_epoch({epoch}) moves back from epoch {self.epoch} (sample {self.position}, a "
                          "restored position?): those epochs are trained again. Start the loop at sampler.epoch: "
                          "for epoch in range(sampler.epoch, epochs)", stacklevel=2)
        if epoch != self.epoch:
            self._check_advanced()
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def check_saved_state(self, state_dict: dict[str, Any]) -> None:
        """``load_state_dict``, and ``loader._load`` before anything is read (``prechecks.py``): refuse the
        state of another dataset length or ``shuffle`` (a permanent ``CheckpointError``), or not a sampler's."""
        if "num_samples" not in state_dict:
            raise mark(CheckpointError(f"ResumableSampler: the saved state {sorted(state_dict)} is not a ResumableSampler's "
                                  "(a ResumableIterable's?): restore a sampler from a sampler's entry"))
        if int(state_dict["num_samples"]) != self.num_samples or bool(state_dict["shuffle"]) != self.shuffle:
            e, p = state_dict.get("epoch"), state_dict.get("position")  # what to do: the epoch to go on at
            nxt = e if p == 0 else e + 1 if isinstance(e, int) else "<the saved epoch + 1>"
            raise mark(CheckpointError(  # permanent: the same at every restart
                f"ResumableSampler: checkpoint has num_samples={state_dict['num_samples']}, "
                f"shuffle={state_dict['shuffle']}; this sampler has {self.num_samples}, {self.shuffle} (saved at epoch {e}, "
                f"sample {p}). Resume with the same dataset, or go on with this one from the next epoch: restore with this "
                f"entry out of the state and strict=False, then call sampler.set_epoch({nxt}) (docs/checkpoints.md)"
            ))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_saved_state(state_dict)
        position, epoch = int(state_dict["position"]), int(state_dict["epoch"])
        if not 0 <= position <= self.num_samples or epoch < 0:
            raise CorruptCheckpointError(
                f"ResumableSampler: saved position {position} (epoch {epoch}) is outside 0..{self.num_samples}"
            )
        if (int(state_dict["seed"]), epoch, position) != (self.seed, self.epoch, self.position):
            self._restores += 1  # a live iterator of the old position is stale (_until_restored)
        self.seed, self.epoch, self.position, self._loaded = int(state_dict["seed"]), epoch, position, self.__dict__.get("_ran_out")


class ResumableIterable(torch.utils.data.IterableDataset):
    """Wrapper for iterable datasets: from the saved ``position``, the stream is read in groups
    of ``W`` items and rank ``r`` takes item ``r`` of each group (global item ``position + r``,
    ``position + r + W``, ...); a resume skips the first ``position`` items by reading them (the
    stream must repeat the same order each epoch: no resumable shuffle). ``make_iter(epoch)``
    opens the stream.

    Every rank reads the whole stream, so every rank sees the same last group: when the stream
    ends in a partial group of ``k < W`` items, ranks ``r >= k`` take item ``r % k`` of it (up to
    ``W - 1`` items seen twice), so every rank yields the same count and lockstep ranks run the
    same number of steps (an uneven count leaves a DDP rank waiting in an all-reduce its peers
    never join). ``drop_last=True`` skips a partial last group instead. :meth:`advance` moves the
    position by ``n * W`` items, padding included: a checkpoint taken in the padded end resumes
    with nothing left of the epoch on any rank.

    ``num_workers > 1`` needs ``batch_size=`` (the DataLoader's): worker ``w`` of ``K`` yields
    blocks ``w, w + K, ...`` of the rank's share cut into blocks of ``batch_size``, so the loader
    yields the same batches as with 0 or 1 workers (:mod:`trainguard.iterworkers`); without it,
    refused (ValueError). ``transform`` runs on the items this rank (and worker) yields only; ``seed=``
    seeds the global generators and its own from ``(seed, epoch, item index)`` around each call, and the ``collate_fn``'s
    after each item (see :func:`trainguard.seeded.seeded_stream`).
    A worker with ``persistent_workers=True`` keeps one copy of the dataset that never sees the
    main process's position or epoch: its second epoch is refused with a ValueError.
    """

    _restores = 0  # load_state_dict calls that moved the position (per instance once one did)
    reads_data = False  # set once iterated or advanced here: capture.check_data_positions compares it

    def __init__(self, make_iter: Callable[[int], Iterable[Any]], *, drop_last: bool = False,
                 rank: SupportsIndex | None = None, world_size: SupportsIndex | None = None,
                 batch_size: SupportsIndex | None = None, transform: Callable[[Any], Any] | None = None,
                 seed: SupportsIndex | None = None) -> None:
        if batch_size is not None and (type(batch_size := whole(batch_size)) is not int or batch_size < 1):  # numpy's too
            raise ValueError(f"ResumableIterable(batch_size={batch_size!r}): the DataLoader's batch_size, an int >= 1")
        check_flags(drop_last=drop_last)
        iterworkers.check_make_iter(make_iter)  # a dataset or list itself: said so here, not at the first batch
        self.make_iter, self.batch_size, self.transform = make_iter, batch_size, transform
        self.seed = None if seed is None else seed_int(seed, "ResumableIterable")
        self.drop_last = bool(drop_last)
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.position = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickling, e.g. into a DataLoader worker: the copy keeps the rank and world size of the
        process that pickled it. A worker started by ``spawn``/``forkserver`` has no process
        group, and would otherwise read the stream as rank 0 of 1 on every rank."""
        state = dict(self.__dict__)
        try:
            state["_pickled_rank_world"] = _rank_world(self._rank, self._world)
        except ValueError:
            pass  # an invalid explicit pair: __iter__ raises it where it is used
        return state

    def _rank_world_here(self) -> tuple[int, int]:
        """``__iter__``'s rank and world size: explicit ones or torch.distributed's; in a DataLoader
        worker without a process group (spawn/forkserver), those of the process that sent the
        worker its copy (see ``__getstate__``). A forked worker has its parent's group: a pair
        pickled earlier (a launcher sending the dataset to its ranks, before any group) is stale."""
        pickled = self.__dict__.get("_pickled_rank_world")
        if pickled is not None and torch.utils.data.get_worker_info() is not None and not _has_group():
            return pickled
        return _rank_world(self._rank, self._world)

    def __iter__(self) -> Iterator[Any]:
        self.reads_data = True  # in this process (a worker's copy marks its own)
        rank, world = self._rank_world_here()
        info = torch.utils.data.get_worker_info()
        if info is not None:
            iterworkers.check_workers(self.batch_size, info.num_workers)
            # Each DataLoader iterator gives a non-persistent worker a fresh copy of the dataset;
            # a persistent worker iterates its one copy again, which never saw advance(),
            # next_epoch() or load_state_dict() in the main process: it would replay its first epoch.
            if getattr(self, "_worker_iterated", False):
                raise ValueError(
                    "ResumableIterable: the DataLoader worker iterates its copy of the dataset again "
                    "(persistent_workers=True); that copy never sees advance(), next_epoch() or "
                    "load_state_dict() of the main process and would replay the epoch it started with. "
                    "Use persistent_workers=False"
                )
            self._worker_iterated = True
        items = iteradvance.counted(self, self._rank_items(rank, world))  # advance()'s check (iteradvance.py)
        if info is not None and info.num_workers > 1:  # this worker's blocks only
            items = iterworkers.worker_share(items, self.batch_size, info.id, info.num_workers)  # type: ignore[arg-type]
        yield from seeded_stream(self, items)  # transform=, seed=: seeded.py

    def _rank_items(self, rank: int, world: int) -> Iterator[Any]:
        """``__iter__``: this rank's share of the stream from the position (item ``rank`` of each
        group), each as ``(its index in the stream, item)``."""
        group: list[Any] = []
        restores, position = self._restores, self.position  # a worker's copy: never restored
        for i, item in enumerate(self.make_iter(self.epoch)):
            if i < position:
                continue
            group.append((i, item))
            if len(group) == world:
                self._check_not_restored(restores)
                yield group[rank]
                group = []
        self._check_not_restored(restores)  # where the loop would end the epoch
        if group and not self.drop_last:
            yield group[rank % len(group)]  # the partial last group, wrapped: same count everywhere

    def _check_not_restored(self, restores: int) -> None:
        """``__iter__`` (``num_workers=0``): refuse to go on reading after :meth:`load_state_dict`
        moved the position (a rollback inside the loop; see ``ResumableSampler._until_restored``)."""
        if self._restores != restores:
            raise RuntimeError(
                "ResumableIterable: its state was restored while a DataLoader iterator was reading it; that "
                "iterator continues from the position before the restore. Leave the loop and iterate the "
                "loader again: the new iterator starts at the restored position (docs/data.md)"
            )

    def advance(self, n: SupportsIndex) -> None:
        """Record that *this rank* consumed ``n`` more items; every rank calls it with the same
        ``n``, so the position moves by ``n * world_size`` (padding of the last group included:
        the stream's length is not known in advance)."""
        self.position += (k := _consumed(n)) * _rank_world(self._rank, self._world)[1]
        self.reads_data = True
        iteradvance.note_advance(self, k)  # more than the iterator gave: warned

    def next_epoch(self) -> None:
        """Every rank, after the last batch of an epoch: start the next one at position 0 (warns when
        ``advance`` counted fewer items than the epoch's iterator gave this rank: iteradvance.py)."""
        iteradvance.check_epoch(self)
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "num_samples" in state_dict:  # positions in an indexed dataset, not in this stream
            raise mark(CheckpointError("ResumableIterable: the saved state is a ResumableSampler's: restore an iterable "
                                  "dataset from an iterable dataset's entry"))
        position, epoch = int(state_dict["position"]), int(state_dict["epoch"])
        if position < 0 or epoch < 0:
            raise CorruptCheckpointError(f"ResumableIterable: saved position {position} (epoch {epoch}) is negative")
        if (epoch, position) != (self.epoch, self.position):
            self._restores += 1  # a live iterator of the old position is stale (_check_not_restored)
        self.epoch, self.position, self._loaded = epoch, position, self.__dict__.get("_ran_out")  # check_reread: restored since
