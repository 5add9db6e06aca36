"""``ResumableSampler``: a data order that survives restarts and world-size changes.

The order of epoch ``e`` is a permutation of ``range(num_samples)`` drawn from ``(seed, e)``
(or the identity without shuffling). The position is kept in *global* samples: how many
samples of this epoch all ranks together have consumed. Rank ``r`` of ``W`` reads the global
order from the position with stride ``W`` (``order[pos + r], order[pos + r + W], ...``), so
``W`` ranks that each consumed ``k`` samples consumed exactly ``order[pos : pos + k * W]``.
After a restart at another world size every rank continues from the same global position, and
over a run every sample of each epoch is consumed exactly once.

Who calls what, on every rank and in this order::

    sampler = tg.ResumableSampler(dataset, seed=0)      # rank/world from torch.distributed
    loader = DataLoader(dataset, batch_size=b, sampler=sampler, num_workers=2)
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
The tail of an epoch that does not divide by ``W`` gives the first ranks one sample more
(exact coverage); pass ``drop_last=True`` for equal counts (the tail is then skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import torch

from .errors import CheckpointError


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world_size is None else world_size)
    return (rank or 0), (world_size or 1)


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Sampler for map-style datasets with a global, resumable position (see module doc).

    ``data``: a sized dataset or the number of samples. ``rank``/``world_size`` default to
    torch.distributed's (read at each ``__iter__``, so a restart at another size just works).
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        if self.num_samples < 1:
            raise ValueError("ResumableSampler: the dataset is empty")
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.position = 0  # global samples of this epoch consumed

    @property
    def rank_world(self) -> tuple[int, int]:
        return _rank_world(self._rank, self._world)

    def order(self, epoch: int | None = None) -> list[int]:
        """The global sample order of ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + e)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def _end(self, world: int) -> int:
        if not self.drop_last:
            return self.num_samples
        return self.position + (self.num_samples - self.position) // world * world

    def __iter__(self) -> Iterator[int]:
        rank, world = self.rank_world
        order = self.order()
        return iter(order[self.position + rank : self._end(world) : world])

    def __len__(self) -> int:
        rank, world = self.rank_world
        return len(range(self.position + rank, self._end(world), world))

    def advance(self, n: int) -> None:
        """Record that *this rank* consumed ``n`` more samples; every rank calls it with the same
        ``n`` (lockstep data parallelism), so the global position moves by ``n * world_size``."""
        _, world = self.rank_world
        self.position = min(self.position + int(n) * world, self.num_samples)

    @property
    def epoch_done(self) -> bool:
        _, world = self.rank_world
        return self.position >= self._end(world)

    def next_epoch(self) -> None:
        """Start the next epoch at position 0."""
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler-compatible: a new epoch starts at 0; the current one (e.g. the
        restored one) keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict["num_samples"]) != self.num_samples or bool(state_dict["shuffle"]) != self.shuffle:
            raise CheckpointError(
                f"ResumableSampler: checkpoint has num_samples={state_dict['num_samples']}, "
                f"shuffle={state_dict['shuffle']}; this sampler has {self.num_samples}, {self.shuffle}. "
                "Resume with the same dataset, or start a new run"
            )
        self.seed = int(state_dict["seed"])
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])


class ResumableIterable(torch.utils.data.IterableDataset):
    """Wrapper for iterable datasets: global sample ``i`` of the stream goes to rank ``i % W``;
    a resume skips the first ``position`` samples by reading them (the stream must repeat the
    same order each epoch: no resumable shuffle). ``make_iter(epoch)`` opens the stream.
    Use it with ``num_workers=0`` (worker processes would each read the whole stream).
    """

    def __init__(self, make_iter: Callable[[int], Iterable[Any]], *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.make_iter = make_iter
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.position = 0

    def __iter__(self) -> Iterator[Any]:
        rank, world = _rank_world(self._rank, self._world)
        for i, item in enumerate(self.make_iter(self.epoch)):
            if i >= self.position and (i - self.position) % world == rank:
                yield item

    def advance(self, n: int) -> None:
        """Same contract as :meth:`ResumableSampler.advance`."""
        self.position += int(n) * _rank_world(self._rank, self._world)[1]

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
