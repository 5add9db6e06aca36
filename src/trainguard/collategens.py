"""The generators a DataLoader's ``collate_fn`` keeps of its own (``self.rng = np.random.default_rng(0)`` in a
mixup or random-crop collator object, a module global a collate function names, a ``functools.partial``'s
``rng=``), seeded for each batch by ``seeded.SeededDataset``.

torch's fetcher (``_MapDatasetFetcher.fetch``, in a DataLoader worker, or in the training process with
``num_workers=0``) calls ``SeededDataset.__getitems__`` (``__getitem__`` with ``batch_size=None``) and then
``collate_fn`` on what it returned, in the same process; the dataset is not told which ``collate_fn`` follows.
:func:`caller_collate` reads it from the fetcher that called (its frame, one up); :class:`CollateSeeder` then seeds
that ``collate_fn``'s own generators (:func:`owngens.own_generators`, and those deeper: ``deepgens``) from the
batch's collate seed ``(seed, epoch, first index, 1)`` and the generator's path, and leaves them so: the collate
call that comes next draws from there. Before, they drew on from wherever that process's copy had got to: a resume
mid-epoch (and each worker) drew differently, silently (review56b). Not put back afterwards: nothing of the
dataset's code runs after ``collate_fn`` to do it, and no other code draws from a collator's own generator.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from torch.utils.data import default_collate, default_convert
from torch.utils.data._utils.fetch import _IterableDatasetFetcher, _MapDatasetFetcher

from .deepgens import deep_paths, resolve
from .owngens import own_generators, seed_own

_FETCH = _MapDatasetFetcher.fetch.__code__
_FETCH_ITER = _IterableDatasetFetcher.fetch.__code__
_TORCH_OWN = (default_collate, default_convert)  # torch's collate functions draw nothing: not looked into


_OWN_FRAMES = 4  # a subclass's __getitems__ calling super(), and its subclass's: the dataset's own methods skipped


def caller_collate(dataset: Any) -> Any:
    """``SeededDataset.__getitems__``/``__getitem__``, first thing: the ``collate_fn`` of torch's fetcher that
    called it (two frames up from here, or further up past methods of ``dataset`` itself: a subclass's
    ``__getitems__`` that calls ``super().__getitems__(keys)``) for ``dataset`` (torch's ``default_collate`` too), or
    ``None`` when other code called it (a dataset wrapping it, a test, ``ds[key]`` by hand). Before session 56
    (review56k) only the frame two up was looked at: a subclass overriding ``__getitems__`` had its ``collate_fn``'s
    generators never seeded, silently (a resume drew differently)."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the top of a thread: no fetcher
        return None
    for _ in range(_OWN_FRAMES):
        if frame.f_code is _FETCH:
            break
        if frame.f_back is None or frame.f_code.co_argcount < 1 or frame.f_locals.get(frame.f_code.co_varnames[0]) is not dataset:
            return None  # not a method of the dataset: other code called it
        frame = frame.f_back
    else:
        return None
    fetcher = frame.f_locals.get("self")
    if not isinstance(fetcher, _MapDatasetFetcher) or fetcher.dataset is not dataset:
        return None
    return fetcher.collate_fn


def draws_nothing(collate: Any) -> bool:
    """torch's own ``default_collate``/``default_convert`` (or none): nothing to seed for it."""
    return collate is None or any(collate is f for f in _TORCH_OWN)


def stream_collate(dataset: Any) -> tuple[Any, int] | None:
    """``seeded.seeded_stream`` (a ``ResumableIterable``'s ``__iter__``, at its first item): the ``collate_fn`` of
    torch's iterable fetcher whose ``next()`` runs it (a few frames up: the generator frames of ``__iter__`` in
    between) and the items it collates at a time (its batch size; 1 with ``DataLoader(batch_size=None)``), or
    ``None`` (iterated by other code)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code is _FETCH_ITER:
            local = frame.f_locals
            fetcher = local.get("self")
            if not isinstance(fetcher, _IterableDatasetFetcher) or fetcher.dataset is not dataset:
                return None
            size = len(local.get("possibly_batched_index") or ()) if fetcher.auto_collation else 1
            return (fetcher.collate_fn, size) if size else None
    return None


class CollateSeeder:
    """Kept by one ``SeededDataset`` (pickled to each worker with it, empty): the deeper paths of the last
    ``collate_fn`` seen, walked once per process and ``collate_fn`` (a list of transforms the collator holds)."""

    def __init__(self) -> None:
        self._key: tuple[int, Any] | None = None  # (pid, the collate_fn): a new worker or collate_fn walks again
        self._deep: tuple = ()
        self._paths: frozenset[str] | None = None  # found at the last batch of this process: one new later is warned
        self._warned = False

    def __getstate__(self) -> dict[str, Any]:
        return {"_key": None, "_deep": (), "_paths": None, "_warned": self._warned}  # no collate_fn: not pickled

    def seed(self, collate: Any, seed: int) -> None:
        """Seed ``collate``'s own generators for the batch whose collate seed is ``seed`` (each from it and its path;
        the same generator reached by two paths once), leaving them seeded for the call that follows."""
        if draws_nothing(collate):
            return
        found = own_generators(collate)
        if self._key is None or self._key[0] != os.getpid() or self._key[1] is not collate:
            self._key, self._paths = (os.getpid(), collate), None
            self._deep = deep_paths(collate, {id(g) for _, g in found}, "SeededDataset (the DataLoader's collate_fn)")
        if self._deep:
            ids = {id(g) for _, g in found}
            found += [(p, g) for p, g in resolve(collate, self._deep) if id(g) not in ids]
        paths = frozenset(p for p, _ in found)
        if self._paths is not None and paths - self._paths and not self._warned:
            self._warned = True
            warnings.warn(
                f"tg.SeededDataset: the DataLoader's collate_fn {type(collate).__name__} made the generator(s) "
                f"{', '.join(sorted(paths - self._paths))} during a batch (on first use): that batch drew from fresh "
                "entropy, and so does the first batch of each worker and after a resume. Make the collate_fn's "
                "generator before the loop (in __init__, or as a module global); it is then seeded for every batch",
                RuntimeWarning, stacklevel=4)
        self._paths = paths
        seed_own(seed, found, [])
