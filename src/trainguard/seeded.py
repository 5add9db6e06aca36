"""``SeededDataset``: random data augmentation that a resume reproduces, with any number of
DataLoader workers.

``tg.RNGState`` restores the training process's generators, not those of DataLoader worker
processes: torch seeds each worker from a base seed drawn when the loader's iterator is created,
and a worker's draws depend on which batches it happened to get. A resumed run creates its
iterator at another point and hands the batches to the workers from the resume point on, so
augmentation drawn in ``__getitem__`` would differ from the uninterrupted run's.

``SeededDataset`` makes every sample's draws a function of ``(seed, epoch, index)`` only: around
each ``dataset[index]`` it seeds Python ``random``, NumPy's global generator and torch's CPU
generator from that triple and restores them afterwards (and the dataset's own generators, kept as its
attributes: :func:`own_generators`). The same sample of the same epoch is
augmented the same way whatever the worker, the number of workers, or where the run resumed.
The keys come from ``ResumableSampler(..., with_epoch=True)``, which yields ``(index, epoch)``::

    sampler = tg.ResumableSampler(dataset, seed=0, with_epoch=True)
    loader = DataLoader(tg.SeededDataset(dataset, seed=0), sampler=sampler, num_workers=2,
                        generator=torch.Generator())
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .collategens import CollateSeeder, caller_collate, draws_nothing, stream_collate
from .deepgens import deep_paths, resolve
from .owngens import dataset_generators, own_generators, run_seeded
from .seedcore import restore_globals, save_globals, seed_globals, seed_int, seed_of, seeded_call

__all__ = ["EpochKey", "SeededDataset", "ignore_stop_signals", "own_generators", "seed_globals", "seed_int", "seed_of",
           "seeded_call", "seeded_items", "seeded_stream"]


def seeded_stream(ds: Any, items: Iterator[tuple[int, Any]]) -> Iterator[Any]:
    """``ResumableIterable.__iter__`` (the process that iterates it: a DataLoader worker, or the training process):
    each ``(index, item)`` of this rank's (and worker's) share, transformed (:func:`seeded_items` with ``seed=``).
    With ``seed=``, the ``collate_fn`` torch's fetcher calls after each batch's last item (found at the first item:
    ``collategens.stream_collate``, with the fetcher's batch size) is seeded from ``(seed, epoch, that item's index)``
    before the item is handed over (or, for a partial last batch, when the stream ends): in a worker the global
    generators, and in any process its own generators. Before, a ``collate_fn`` drawing from ``torch.rand`` in a
    worker drew from wherever that worker's generators had got to, and a resume differed (review56b)."""
    tf, seed, epoch = ds.transform, ds.seed, ds.epoch
    if seed is None:
        yield from (item if tf is None else tf(item) for _, item in items)
        return
    pairs = _seeded_pairs(seed, epoch, tf, items) if tf is not None else iter(items)
    worker = torch.utils.data.get_worker_info() is not None
    seeder, k, last = CollateSeeder(), 0, 0
    collate: Any = None
    size = 0  # items per collate_fn call; 0: no fetcher found, or torch's own collate_fn (draws nothing)

    def seed_collate(index: int) -> None:
        cseed = seed_of(seed, epoch, index, 1)  # 4 words: never an item's seed
        if worker:
            seed_globals(cseed)
        seeder.seed(collate, cseed)

    for i, out in pairs:
        if k == 0:
            collate, size = stream_collate(ds) or (None, 0)
            size = 0 if draws_nothing(collate) else size
        k, last = k + 1, i
        if size and k % size == 0:  # this batch's last item
            seed_collate(i)
        yield out
    if size and k % size:  # a partial last batch, collated after the StopIteration
        seed_collate(last)


def seeded_items(seed: int, epoch: int, transform: Callable[[Any], Any], items: Iterable[tuple[int, Any]]) -> Iterator[Any]:
    """``ResumableIterable(transform=, seed=).__iter__`` (in the process that iterates it: a DataLoader worker,
    or the training process): ``transform(item)`` for each ``(index, item)``, with the global generators and the
    transform's own (:func:`own_generators`, looked up before each call: training code may run between two items
    and rebind one) seeded from ``(seed, epoch, index)``, and all of them put back after each call. A generator
    the transform made on its first call (``if self.rng is None: self.rng = np.random.default_rng()``) drew
    unseeded there: that item is transformed once more with it seeded (before, its draws differed at every run),
    from a copy of it taken before the first call (:func:`_kept`: the first item of each iterator, where such a
    generator is made; before, a transform that changes its item in place, ``d["x"] = d["x"] + rng.random()``,
    augmented it twice, and the first item after a resume differed from the uninterrupted run's)."""
    return (out for _, out in _seeded_pairs(seed, epoch, transform, items))


def _seeded_pairs(seed: int, epoch: int, transform: Callable[[Any], Any],
                  items: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """:func:`seeded_items`, each transformed item with its index (:func:`seeded_stream` seeds the collate_fn from it)."""
    deep = deep_paths(transform, {id(g) for _, g in own_generators(transform)}, "ResumableIterable(transform=)")

    rewalk = [True]  # after the first item: a transform deeper in the object made its generator on first use

    def find() -> list[tuple[str, Any]]:
        return with_deep(own_generators(transform), transform, deep)

    def find_after() -> list[tuple[str, Any]]:
        nonlocal deep
        if rewalk[0]:
            rewalk[0] = False
            deep = deep_paths(transform, {id(g) for _, g in own_generators(transform)}, None)
        return find()

    first = True
    for i, item in items:
        saved = save_globals()
        try:
            out, _ = run_seeded(seed_of(seed, epoch, i), find(), find_after, transform, item,
                                again=_kept(item, i) if first else None)
        finally:
            restore_globals(saved)
        first = False
        yield i, out


def _kept(item: Any, index: int) -> Callable[[], tuple[Any]]:
    """``seeded_items``, before the first item's call: what ``run_seeded`` transforms again, should the call make a
    generator: a deep copy of the item as it is now, copied again for each call. An item that cannot be copied (an
    open file, a stream) is transformed again as the first call left it, with a ``RuntimeWarning``."""
    try:
        kept = copy.deepcopy(item)
    except Exception as e:  # noqa: BLE001 - any item: a file object, a socket, a lock
        why = f"{type(e).__name__}: {e}"

        def as_left() -> tuple[Any]:
            warnings.warn(
                f"ResumableIterable(transform=): the transform made a generator on its first call (item {index}), so "
                f"that item is transformed again with it seeded; the item could not be copied ({why}) and "
                "is passed as the first call left it (a stream already read, a dict already changed): make "
                "the transform's generator before the loop (in __init__, or as a module global)", RuntimeWarning,
                stacklevel=2)
            return (item,)
        return as_left
    return lambda: (copy.deepcopy(kept),)


def with_deep(found: list[tuple[str, Any]], root: Any, deep: tuple) -> list[tuple[str, Any]]:
    """``found`` (:func:`own_generators`, each sample) and the generators at the deeper paths remembered for ``root``
    (``deepgens``: in a list, a dict, a ``Compose``'s transforms), each generator once."""
    if not deep:
        return found
    ids, out = {id(g) for _, g in found}, list(found)
    for path, g in resolve(root, deep):
        if id(g) not in ids:
            ids.add(id(g))
            out.append((path, g))
    return out


class EpochKey(tuple):
    """The ``(index, epoch)`` key ``ResumableSampler(with_epoch=True)`` yields, for ``SeededDataset``. A torch
    ``ConcatDataset`` or ``Subset`` that gets it (``ConcatDataset([tg.SeededDataset(a), tg.SeededDataset(b)])``)
    compares it with an int or indexes a list with it: a ``TypeError`` saying to put ``SeededDataset`` outermost
    (before: torch's ``'<' not supported between instances of 'tuple' and 'int'``)."""

    __slots__ = ()

    def _refuse(self, other: Any = None) -> Any:
        raise TypeError(
            f"a dataset got the key {tuple(self)!r} (index, epoch) of tg.ResumableSampler(with_epoch=True) and used it "
            "as an index: tg.SeededDataset must be the DataLoader's dataset, around the others. Write "
            "tg.SeededDataset(ConcatDataset([a, b]), seed=0) (or tg.SeededDataset(Subset(ds, idx), seed=0)), not "
            "ConcatDataset([tg.SeededDataset(a, seed=0), ...]): it seeds the generators of the datasets they wrap too")

    def __lt__(self, other: Any) -> Any:
        return self._refuse() if isinstance(other, int) else tuple.__lt__(self, other)

    def __le__(self, other: Any) -> Any:
        return self._refuse() if isinstance(other, int) else tuple.__le__(self, other)

    def __gt__(self, other: Any) -> Any:
        return self._refuse() if isinstance(other, int) else tuple.__gt__(self, other)

    def __ge__(self, other: Any) -> Any:
        return self._refuse() if isinstance(other, int) else tuple.__ge__(self, other)

    __index__ = _refuse

    def __reduce__(self) -> Any:
        return EpochKey, (tuple(self),)


class SeededDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset; ``self[(index, epoch)]`` is ``dataset[index]`` computed with
    Python ``random``, NumPy's global generator and torch's CPU generator seeded from
    ``(seed, epoch, index)`` (the generators' previous states are restored afterwards, so the
    caller's random stream is untouched when ``num_workers=0``), and so are the generators the
    dataset keeps as attributes or attributes of its attributes (``self.rng =
    np.random.default_rng(0)``, ``self.transform.rng``: :func:`own_generators`), each from that seed
    and its attribute path. Before, those drew on from wherever the worker's copy (or, with
    ``num_workers=0``, the training process's, which ``RNGState`` does not save) had got to: a resume
    mid-epoch augmented differently, silently. Generators kept deeper (in a list, a ``Compose``'s transforms)
    are looked for at the first batch of each process (``deepgens``), and followed by path at each sample. ``SeededDataset`` must be the
    DataLoader's dataset (around a ``ConcatDataset``/``Subset``: :class:`EpochKey`).

    In a DataLoader worker, the batch's ``collate_fn`` runs right after the batch's items
    (``__getitems__``): the worker's generators are left seeded from ``(seed, epoch, first index
    of the batch)`` for it, so random draws in a ``collate_fn`` (masking, mixing) resume too. In
    the training process (``num_workers=0``) they draw from its own generators, which
    ``tg.RNGState`` saves."""

    def __init__(self, dataset: Any, *, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed_int(seed, "SeededDataset")
        # generators kept deeper (a list of them, a Compose's transforms): looked for here (a SeedSequence warned
        # about where the dataset is built), and again at the first batch of each process (a transform set after
        # this, a worker_init_fn's), then followed by path at each sample
        self._deep = deep_paths(dataset, {id(g) for _, g in dataset_generators(dataset)}, "tg.SeededDataset")
        self._deep_pid: int | None = None
        self._rewalk = False  # walk them again after the first sample of the process: _generators_after
        self._collate = CollateSeeder()  # the generators of the collate_fn that torch's fetcher calls next

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_seed(self, index: int, epoch: int) -> int:
        """The 64-bit seed of one sample of one epoch."""
        return seed_of(self.seed, epoch, index)

    def __getitem__(self, key: Any) -> Any:
        """``dataset[index]``, seeded; called by torch's fetcher only with ``DataLoader(batch_size=None)`` (no
        auto-collation), and then seeded for its ``collate_fn`` as a batch of one is (:meth:`__getitems__`; before,
        a ``collate_fn`` there drew from wherever the worker's generators had got to: a resume differed)."""
        collate = caller_collate(self)
        if collate is None:
            return self._fetch([key], keep_globals=True)[0]
        worker = torch.utils.data.get_worker_info() is not None
        item = self._fetch([key], keep_globals=not worker)[0]
        self._seed_collate(collate, key, worker)
        return item

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """torch's fetcher, for one batch (then ``collate_fn`` on the result, in the same process). The global
        generators are saved once for the batch and put back after it (~70 us a sample less than around each
        sample: NumPy's state is slow to copy); in a DataLoader worker not at all, since they are seeded for the
        batch's ``collate_fn`` right after it."""
        collate = caller_collate(self)
        worker = torch.utils.data.get_worker_info() is not None
        items = self._fetch(keys, keep_globals=not worker)
        if keys:  # the next draws are collate_fn's
            self._seed_collate(collate, keys[0], worker)
        return items

    def _seed_collate(self, collate: Any, key: tuple[int, int], worker: bool) -> None:
        """After a batch's items, for the ``collate_fn`` torch calls next on them: in a worker the global
        generators, and in any process that ``collate_fn``'s own generators (``collategens``), seeded from
        ``(seed, epoch, first index of the batch)`` (with ``num_workers=0`` the global ones are the training
        process's, which ``tg.RNGState`` saves)."""
        index, epoch = key
        seed = seed_of(self.seed, epoch, index, 1)  # 4 words: never a sample's seed
        if worker:
            seed_globals(seed)
        if collate is not None:
            if getattr(self, "_collate", None) is None:  # a subclass that did not call __init__
                self._collate = CollateSeeder()
            self._collate.seed(collate, seed)

    def _generators(self) -> list[tuple[str, Any]]:
        return with_deep(dataset_generators(self.dataset), self.dataset, self._deep)

    def _generators_after(self) -> list[tuple[str, Any]]:
        """``run_seeded``'s look after each call: after the first sample of each process the deeper paths are walked
        again, so that a transform in a ``Compose`` that made its generator on first use (``if self.rng is None``)
        is found there and that sample computed again with it seeded (before, it was never seeded: a resume
        differed)."""
        if getattr(self, "_rewalk", False):
            self._rewalk = False
            self._deep = deep_paths(self.dataset, {id(g) for _, g in dataset_generators(self.dataset)}, None)
        return self._generators()

    def _fetch(self, keys: list[Any], keep_globals: bool) -> list[Any]:
        """``dataset[index]`` for each key, each under :func:`run_seeded`: the dataset's own generators are looked up
        once before the first and again after each call (a generator made in ``__getitem__`` on first use is then
        seeded, and that sample computed again). ``keep_globals``: the global generators are put back at the end."""
        for key in keys:
            if not (isinstance(key, tuple) and len(key) == 2):
                raise TypeError(
                    f"SeededDataset got key {key!r}; it needs (index, epoch) keys: "
                    "use tg.ResumableSampler(..., with_epoch=True) as the DataLoader's sampler"
                )
        if getattr(self, "_deep_pid", None) != os.getpid():
            self._deep = deep_paths(self.dataset, {id(g) for _, g in dataset_generators(self.dataset)}, None)
            self._deep_pid = os.getpid()
            self._rewalk = True
        saved = save_globals() if keep_globals else None
        try:
            gens, items = self._generators(), []
            for index, epoch in keys:
                item, gens = run_seeded(self.sample_seed(index, epoch), gens, self._generators_after, self.dataset.__getitem__,
                                        index)
                items.append(item)
            return items
        finally:
            if saved is not None:
                restore_globals(saved)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader ``worker_init_fn`` (or a call inside yours): this worker process ignores
    SIGINT and SIGHUP, and SIGTERM unless its parent sent it, so that a stop signal sent to the whole process
    group reaches only the training process, whose ``CheckpointManager`` saves at its next
    ``save()`` and stops.

    Slurm (preemption, ``scancel``) signals every process of the job step, Ctrl-C every process
    of the terminal's group: torch's worker handler dies of a SIGTERM that its parent did not
    send, and the training process then raises ``RuntimeError: DataLoader worker ... is killed by
    signal`` (from its SIGCHLD handler, anywhere in the step) before it reaches the preemption
    save. A SIGTERM from the loader's process (its shutdown, multiprocessing's at exit) still ends
    the worker at once, as torch's handler does: SIGTERM is blocked and a thread takes it with
    ``sigwaitinfo``, which says who sent it."""
    import multiprocessing
    import os
    import signal
    import threading

    del worker_id  # the worker_init_fn signature
    for sig in (signal.SIGINT, signal.SIGHUP):  # stop signals the manager handles (its loader never sends them)
        signal.signal(sig, signal.SIG_IGN)
    # The loader's process: the parent, but for multiprocessing_context="forkserver" (the forkserver's child).
    creator = multiprocessing.parent_process()
    parents = {os.getppid(), *([creator.pid] if creator is not None and creator.pid else [])}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit it

    def take() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid in parents:
                os._exit(0)  # torch's handler exits so too: a worker stopped by its loader

    threading.Thread(target=take, name="trainguard-worker-sigterm", daemon=True).start()
