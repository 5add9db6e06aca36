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

import functools
import inspect
import operator
import random
import types
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def seed_int(seed: Any, who: str) -> int:
    """``ResumableSampler``/``SeededDataset``: ``int(seed)``, or a TypeError that names the argument (``seed=None``,
    an unset ``args.seed``: int()'s "argument must be a string ... not 'NoneType'" before)."""
    if isinstance(seed, bool | np.bool_) or (isinstance(seed, torch.Tensor) and seed.dtype == torch.bool):
        # seed=True is an int to Python (1): a flag passed where the seed goes (``seed=args.shuffle``)
        raise TypeError(f"{who}(seed={seed!r}): a bool is not a seed; pass an int seed, the same on every rank "
                        "and at every restart (e.g. seed=0)")
    try:
        return operator.index(seed)  # an int, NumPy's or a tensor's (an integer dtype)
    except TypeError:
        pass
    try:
        got = int(seed)
        # int() truncates: seed=1.7 and seed=1.2 gave one order, as two runs "with different seeds" (an int
        # string, "7" from argv, and a whole float, 3.0 from a config, are what they say).
        whole = isinstance(seed, str) or float(seed) == got
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise TypeError(f"{who}(seed={seed!r}): pass an int seed (a whole number, not truncated), the same on every "
                        "rank and at every restart (e.g. seed=0)") from None
    return got


def seed_of(*words: int) -> int:
    """A 64-bit seed from a few non-negative ints (``SeedSequence``: distinct tuples, unrelated seeds)."""
    got = np.random.SeedSequence([int(w) % 2**64 for w in words]).generate_state(2, np.uint32)
    return int(got[0]) | int(got[1]) << 32


# NumPy's key gets this third word: ``random.seed(seed)`` seeds Python's MT19937 with ``init_by_array`` of
# the seed's 32-bit words, which is what ``np.random.seed([lo, hi])`` does too, so both generators drew the
# same numbers (``random.random() == np.random.rand()`` for every sample; torch seeds them apart in its
# DataLoader workers, ``_generate_state``). Python's key never has a third word: every seed here is < 2**64.
_NUMPY_KEY = 0x6E756D70


def seed_globals(seed: int) -> None:
    """Seed Python ``random``, NumPy's global generator and torch's CPU generator from ``seed``, each to
    its own stream (``seeded_call``, ``SeededDataset.__getitems__``)."""
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, _NUMPY_KEY])
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed would reseed every CUDA device too


def seeded_call(seed: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the global generators seeded from ``seed``, and their states before the
    call restored after it."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        seed_globals(seed)
        return fn(*args)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def own_generators(obj: Any) -> list[tuple[str, Any]]:
    """The generators a dataset keeps as attributes, ``self.rng = np.random.default_rng(0)`` (or as a class
    attribute), or as attributes of its attributes (``self.transform.rng``), by path, each once: ``random.Random``,
    NumPy's ``Generator`` and ``RandomState``, and CPU ``torch.Generator``. ``SeededDataset`` seeds them with the
    global ones, and so does ``ResumableIterable(transform=, seed=)`` with those of its transform (a callable
    object's attributes, a bound method's object's, a function's closure variables and the module globals it
    names, a ``functools.partial``'s function, arguments and keywords, and theirs). Attributes are read from the
    objects' ``__dict__`` only: no property, ``__getattr__`` or descriptor runs."""
    if inspect.ismethod(obj):  # a ResumableIterable's transform=: a bound method's object
        obj = obj.__self__
    names = _members(obj, own_class=True)
    if isinstance(obj, functools.partial):  # transform=functools.partial(augment, rng=rng): augment's too
        names.update((f"func.{p}", g) for p, g in own_generators(obj.func))
    found: list[tuple[str, Any]] = []
    ids: set[int] = set()  # one generator reachable by two paths is seeded (and put back) once
    for name, value in sorted(names.items()):
        inner = [(name, value)] if _kind(value) else [] if isinstance(value, type | torch.Tensor | types.ModuleType) \
            else [(f"{name}.{k}", v) for k, v in sorted(_members(value).items()) if _kind(v)]
        for path, g in inner:
            if id(g) not in ids:
                ids.add(id(g))
                found.append((path, g))
    return found


def _members(obj: Any, own_class: bool = False) -> dict[str, Any]:
    """``own_generators``: an object's attributes by name, read without running its code (its ``__dict__``,
    a ``__getattr__`` that makes up attributes is never asked: a config object with ``__slots__`` answered
    ``None`` for ``__dict__``), with a function's closure variables and the module globals it names, a partial's
    arguments; ``own_class``: and the generators its class (or a base) keeps as class attributes."""
    if inspect.isfunction(obj):  # a function's globals it names and its closure: what it draws from
        got = {n: obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__}
        for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            try:
                got[n] = c.cell_contents
            except ValueError:  # an empty cell
                pass
        return got
    if isinstance(obj, functools.partial):
        return {**{f"args{i}": a for i, a in enumerate(obj.args)}, **obj.keywords}
    d = None
    if type(obj).__dictoffset__:  # not a list, a dict, an array, an object with __slots__ only: no exception to catch
        try:
            d = object.__getattribute__(obj, "__dict__")
        except Exception:
            pass
    got = {k: v for k, v in d.items() if type(k) is str} if isinstance(d, dict) else {}
    if own_class and not isinstance(obj, type):  # class rng = np.random.default_rng(0), self.rng in __getitem__
        got = {**{k: getattr(type(obj), k) for k in _class_generators(type(obj))}, **got}  # the instance's wins
    return got


@functools.lru_cache(maxsize=256)
def _class_generators(cls: type) -> tuple[str, ...]:
    """The names of the generators a class or its bases keep as class attributes (looked for once per class;
    their values are read at each sample)."""
    return tuple(sorted({k for c in cls.__mro__[:-1] for k, v in vars(c).items() if _kind(v)}))


def dataset_generators(dataset: Any) -> list[tuple[str, Any]]:
    """``SeededDataset``: :func:`own_generators` of the dataset, and of its class's ``__getitem__`` (the module
    globals it names: ``RNG = np.random.default_rng(0)`` at the top of the module), each generator once; those
    of the datasets a torch ``Subset`` or ``ConcatDataset`` wraps too, as of a dataset of their own (before,
    a ``ConcatDataset``'s datasets' generators were not found: each sample drew differently every time)."""
    found, ids = [], set()
    inner = [("dataset.", dataset.dataset)] if isinstance(dataset, torch.utils.data.Subset) else \
        [(f"datasets.{i}.", d) for i, d in enumerate(dataset.datasets)] \
        if isinstance(dataset, torch.utils.data.ConcatDataset) else []
    for path, g in own_generators(dataset) + own_generators(getattr(type(dataset), "__getitem__", None)) + \
            [(f"{p}{q}", g) for p, d in inner for q, g in dataset_generators(d)]:
        if id(g) not in ids:
            ids.add(id(g))
            found.append((path, g))
    return found


_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random, torch.Generator)


def _kind(g: Any) -> bool:
    """A generator ``seeded_own`` seeds (a tuple ``isinstance`` first: it runs on every attribute of every sample)."""
    if not isinstance(g, _GENERATORS):
        return False
    if isinstance(g, random.Random):  # not SystemRandom (the OS's entropy: no state)
        return type(g).getstate is not random.SystemRandom.getstate
    return not isinstance(g, torch.Generator) or g.device.type == "cpu"  # a CUDA generator: not this process's CPU


def seeded_own(seed: int, gens: list[tuple[str, Any]], fn: Callable[..., Any], *args: Any) -> Any:
    """``seeded_call``, with the dataset's own generators ``gens`` (:func:`own_generators`) seeded too, each
    from ``seed`` and its path, and put back afterwards (in reverse order, also when seeding one raised)."""
    if not gens:
        return seeded_call(seed, fn, *args)
    saved: list[tuple[Any, Any]] = []
    try:
        for path, g in gens:
            s = seed_of(seed, zlib.crc32(path.encode()), 0, 0, 3)  # 5 words: never a sample's (3) nor a collate's (4)
            if isinstance(g, np.random.Generator):
                saved.append((g, g.bit_generator.state))
                g.bit_generator.state = type(g.bit_generator)(s).state
            elif isinstance(g, np.random.RandomState):
                saved.append((g, g.get_state()))
                g.seed([s & 0xFFFFFFFF, s >> 32])
            elif isinstance(g, random.Random):
                saved.append((g, g.getstate()))
                g.seed(s)
            else:
                saved.append((g, g.get_state()))
                g.manual_seed(s)
        return seeded_call(seed, fn, *args)
    finally:
        for g, st in reversed(saved):  # the same generator twice (by two paths): its first state wins
            if isinstance(g, np.random.Generator):
                g.bit_generator.state = st
            elif isinstance(g, random.Random):
                g.setstate(st)
            else:
                g.set_state(st)


def seeded_transform(seed: int, transform: Callable[[Any], Any], item: Any) -> Any:
    """``ResumableIterable(transform=, seed=).__iter__``, for each item: ``transform(item)`` under :func:`seeded_own`
    with the transform's own generators looked up at each call (before, once per epoch: a generator the transform
    made on its first call, ``if self.rng is None: self.rng = np.random.default_rng()``, or a module global rebound
    meanwhile, was never seeded that epoch and drew differently at every run)."""
    return seeded_own(seed, own_generators(transform), transform, item)


class SeededDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset; ``self[(index, epoch)]`` is ``dataset[index]`` computed with
    Python ``random``, NumPy's global generator and torch's CPU generator seeded from
    ``(seed, epoch, index)`` (the generators' previous states are restored afterwards, so the
    caller's random stream is untouched when ``num_workers=0``), and so are the generators the
    dataset keeps as attributes or attributes of its attributes (``self.rng =
    np.random.default_rng(0)``, ``self.transform.rng``: :func:`own_generators`), each from that seed
    and its attribute path. Before, those drew on from wherever the worker's copy (or, with
    ``num_workers=0``, the training process's, which ``RNGState`` does not save) had got to: a resume
    mid-epoch augmented differently, silently. Generators kept deeper (in a list of transforms) are not
    found: draw from the global ones there.

    In a DataLoader worker, the batch's ``collate_fn`` runs right after the batch's items
    (``__getitems__``): the worker's generators are left seeded from ``(seed, epoch, first index
    of the batch)`` for it, so random draws in a ``collate_fn`` (masking, mixing) resume too. In
    the training process (``num_workers=0``) they draw from its own generators, which
    ``tg.RNGState`` saves."""

    def __init__(self, dataset: Any, *, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed_int(seed, "SeededDataset")

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_seed(self, index: int, epoch: int) -> int:
        """The 64-bit seed of one sample of one epoch."""
        return seed_of(self.seed, epoch, index)

    def __getitem__(self, key: Any) -> Any:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(
                f"SeededDataset got key {key!r}; it needs (index, epoch) keys: "
                "use tg.ResumableSampler(..., with_epoch=True) as the DataLoader's sampler"
            )
        index, epoch = key
        return seeded_own(self.sample_seed(index, epoch), dataset_generators(self.dataset), self.dataset.__getitem__, index)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """torch's fetcher, for one batch (then ``collate_fn`` on the result, in the same process)."""
        items = [self[k] for k in keys]
        if keys and torch.utils.data.get_worker_info() is not None:  # the next draws are collate_fn's
            index, epoch = keys[0]
            seed_globals(seed_of(self.seed, epoch, index, 1))  # 4 words: never a sample's seed
        return items


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
