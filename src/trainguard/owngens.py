"""The generators a dataset or a ``ResumableIterable`` transform keeps of its own, found and seeded around
each sample (``seeded.SeededDataset`` and ``seeded.seeded_items`` call them, in the process that computes
the sample: a DataLoader worker, or the training process with ``num_workers=0``).

:func:`own_generators` finds them by path (``rng``, ``transform.rng``, ``RNG`` for a module global);
:func:`run_seeded` seeds each from the sample's seed and its path, calls the dataset, puts them back, and
looks again afterwards: a generator the call made (``if self.rng is None: self.rng = np.random.default_rng()``)
drew from fresh entropy there, so the sample is computed once more with it seeded (once per process and
generator). Attributes are read from ``__dict__`` and ``__slots__`` only (no property, ``__getattr__`` or descriptor
runs); a bound method kept as an attribute (``self.transform = aug.apply``) is looked into through its object.
"""

from __future__ import annotations

import functools
import inspect
import random
import types
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .seedcore import seed_globals, seed_of

_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random, torch.Generator)
# Classes whose methods' module globals are not looked at: torch's Dataset, typing.Generic, the standard library's
_LIBRARY = frozenset({"torch", "numpy", "builtins", "typing", "abc", "random", "functools", "collections"})


# type -> 0: not a generator, 1: one, 2: a torch.Generator (its device decides). ``isinstance(x, torch.Generator)``
# runs torch's metaclass ``__instancecheck__``, Python code (~3 us): on every attribute of every sample, it took
# about as long as the rest of the lookup (review55b, profiled).
_TYPE_KIND: dict[type, int] = {}


def _kind(g: Any) -> bool:
    """A generator ``run_seeded`` seeds (it runs on every attribute of every sample: by type, cached)."""
    t = type(g)
    k = _TYPE_KIND.get(t)
    if k is None:
        if not isinstance(g, _GENERATORS):
            k = 0
        elif isinstance(g, random.Random):  # not SystemRandom (the OS's entropy: no state)
            k = int(type(g).getstate is not random.SystemRandom.getstate)
        else:
            k = 2 if isinstance(g, torch.Generator) else 1
        if t is g.__class__:  # not a weakref.proxy (whose __class__ is its referent's): decided by the type
            _TYPE_KIND[t] = k
    return k == 1 or (k == 2 and g.device.type == "cpu")  # a CUDA generator: not this process's CPU


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a function's code (and the code nested in it: a comprehension, a lambda) may read."""
    return tuple(sorted({*code.co_names, *(n for c in code.co_consts if isinstance(c, types.CodeType)
                                           for n in _code_names(c))}))


def closure_cells(fn: types.FunctionType) -> dict[str, Any]:
    """A function's closure variables by name, the empty cells left out (``own_generators`` here, each sample, and
    ``deepgens`` for a ``ResumableIterable`` transform function's closure)."""
    got = {}
    for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            got[n] = c.cell_contents
        except ValueError:  # an empty cell
            pass
    return got


def _function_members(fn: types.FunctionType) -> dict[str, Any]:
    """A function's module globals it names (also in its comprehensions) and its closure variables."""
    g = fn.__globals__
    return {**{n: g[n] for n in _code_names(fn.__code__) if n in g}, **closure_cells(fn)}


_SLOTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _slots(cls: type) -> tuple[tuple[str, Any], ...]:
    """Looked at once per class: the ``__slots__`` of its classes as ``(attribute name, member descriptor)`` (a
    private ``__x`` under its mangled name, as ``__dict__`` would show it). ``@dataclass(slots=True)`` makes them."""
    got = {}
    for c in reversed(cls.__mro__):
        names = vars(c).get("__slots__", ())
        for n in (names,) if isinstance(names, str) else names if isinstance(names, tuple | list | dict | set | frozenset) else ():
            if not isinstance(n, str) or n in ("__dict__", "__weakref__"):
                continue
            if n.startswith("__") and not n.endswith("__"):
                n = f"_{c.__name__.lstrip('_')}{n}"
            d = vars(c).get(n)
            if type(d) is types.MemberDescriptorType:
                got[n] = d
    return tuple(got.items())


def instance_attrs(obj: Any) -> dict[str, Any]:
    """An object's attributes, read without running any of its code: its ``__dict__`` (a ``__getattr__`` that makes
    up attributes is never asked: a config object with ``__slots__`` answered ``None`` for ``__dict__``) and the
    values in its ``__slots__`` (read through their member descriptors, C code; before, a generator kept in a slot,
    ``@dataclass(slots=True) class Jitter: rng: np.random.Generator``, was never seeded: a resume drew differently).
    ``own_generators`` here and ``deepgens`` (every sample) call it."""
    got: dict[str, Any] = {}
    cls = type(obj)
    if cls.__dictoffset__:  # not a list, a dict, an array, an object with __slots__ only: no exception to catch
        try:
            dd = object.__getattribute__(obj, "__dict__")
        except Exception:
            dd = None
        if isinstance(dd, dict):
            got = {k: v for k, v in dd.items() if type(k) is str}
    slots = _SLOTS.get(cls)
    if slots is None:  # a plain dict: this runs for every attribute of every sample (an lru_cache call cost more)
        if len(_SLOTS) > 4096:  # classes made on the fly
            _SLOTS.clear()
        slots = _SLOTS[cls] = _slots(cls)
    for n, d in slots:
        try:
            got[n] = d.__get__(obj, cls)
        except AttributeError:  # a slot never set
            pass
    return got


def _user(c: type) -> bool:
    return str(getattr(c, "__module__", "")).split(".")[0] not in _LIBRARY


@functools.lru_cache(maxsize=256)
def _class_data(cls: type) -> tuple[str, ...]:
    """Looked at once per class: the names of its (and its bases') data class attributes (``rng =
    np.random.default_rng(0)``, also ``rng = None`` filled in on first use: their values are read at each sample;
    before, only those holding a generator when first looked at were remembered). Classes of torch, NumPy and the
    standard library are skipped."""
    return tuple(sorted({k for c in cls.__mro__[:-1] if _user(c) for k, v in vars(c).items()
                         if not (k.startswith("__") or callable(v) or hasattr(type(v), "__get__")
                                 or isinstance(v, type | types.ModuleType))}))


@functools.lru_cache(maxsize=512)
def _reachable(cls: type, entries: tuple[str, ...]) -> tuple[types.FunctionType, ...]:
    """Looked at once per class: the functions its classes define that ``entries`` (``__getitem__``, ``__call__``)
    may call by name, ``self.augment(x)``, and those they may call, and so on (their module globals are looked at:
    a helper method drawing from ``RNG``). Classes of torch, NumPy and the standard library are skipped."""
    funcs: dict[str, types.FunctionType] = {}
    for c in reversed(cls.__mro__[:-1]):  # a subclass's method wins
        if _user(c):
            for k, v in vars(c).items():
                f = v.__func__ if isinstance(v, staticmethod | classmethod) else v
                if inspect.isfunction(f):
                    funcs[k] = f
    todo = [e for e in entries if e in funcs]
    seen = set(todo)
    while todo:
        for n in _code_names(funcs[todo.pop()].__code__):
            if n in funcs and n not in seen:
                seen.add(n)
                todo.append(n)
    return tuple(funcs[n] for n in sorted(seen))


_ENTRIES = ("__call__", "__getitem__", "forward")


def _class_value(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        d = vars(c)
        if name in d:
            return d[name]
    return None


def _members(obj: Any, own_class: bool = False) -> dict[str, Any]:
    """``own_generators``: an object's attributes by name, read without running its code (its ``__dict__`` and
    ``__slots__``: :func:`instance_attrs`), with a function's closure variables and the module globals it names, a partial's
    arguments; the generators its class keeps as class attributes and those among the module globals its class's
    ``__call__``/``forward`` (and the methods they call) name; ``own_class``: all its data class attributes."""
    if inspect.isfunction(obj):  # a function's globals it names and its closure: what it draws from
        return _function_members(obj)
    if isinstance(obj, types.MethodType):  # self.transform = aug.apply: aug's attributes and what apply names (before: none)
        return {**_function_members(obj.__func__), **_members(obj.__self__)} if inspect.isfunction(obj.__func__) \
            else _members(obj.__self__)
    if isinstance(obj, functools.partial):
        return {**{f"args{i}": a for i, a in enumerate(obj.args)}, **obj.keywords}
    if isinstance(obj, type):
        return {}
    got = instance_attrs(obj)
    cls = type(obj)  # class rng = np.random.default_rng(0), self.rng in __getitem__: the instance's wins
    kept = ((k, _class_value(cls, k)) for k in _class_data(cls))  # each looked up once (was twice)
    got = {**{k: v for k, v in kept if own_class or _kind(v)}, **got}
    if not own_class:  # a transform object's __call__ drawing from RNG = np.random.default_rng(0) at its module's top
        for f in _reachable(cls, _ENTRIES):
            got.update((n, v) for n, v in _function_members(f).items() if _kind(v) and n not in got)
    return got


def own_generators(obj: Any) -> list[tuple[str, Any]]:
    """The generators a dataset keeps as attributes, ``self.rng = np.random.default_rng(0)`` (or as a class
    attribute), or as attributes of its attributes (``self.transform.rng``), the module globals its ``__getitem__``
    (or ``__call__``) and the methods it calls by name (``self.augment(x)``) name, also in a comprehension (``RNG =
    np.random.default_rng(0)``, or one a module function they name uses) and those a transform attribute's
    ``__call__`` names, by path, each once: ``random.Random``, NumPy's ``Generator`` and ``RandomState``,
    and CPU ``torch.Generator``. Likewise for a ``ResumableIterable`` transform (a callable object's, a bound
    method's object's, a function's closure variables and the module globals it names, a ``functools.partial``'s
    function, arguments and keywords, and theirs). Not found: generators in a list, dict or tuple, or deeper."""
    entries = _ENTRIES
    if inspect.ismethod(obj):  # a ResumableIterable's transform=: a bound method's object, from that method on
        entries, obj = (*_ENTRIES, obj.__func__.__name__), obj.__self__
    groups = [_members(obj, own_class=True)]
    if isinstance(obj, functools.partial):  # transform=functools.partial(augment, rng=rng): augment's too
        groups[0].update((f"func.{p}", g) for p, g in own_generators(obj.func))
    elif not (inspect.isfunction(obj) or isinstance(obj, type | types.ModuleType)):
        groups.append({n: v for f in _reachable(type(obj), entries) for n, v in _function_members(f).items()})
    found: list[tuple[str, Any]] = []
    ids: set[int] = set()  # one generator reachable by two paths is seeded (and put back) once
    for names in groups:
        for name, value in sorted(names.items()):
            inner = [(name, value)] if _kind(value) else [] if isinstance(value, type | torch.Tensor | types.ModuleType) \
                else [(f"{name}.{k}", v) for k, v in sorted(_members(value).items()) if _kind(v)]
            for path, g in inner:
                if id(g) not in ids:
                    ids.add(id(g))
                    found.append((path, g))
    return found


def dataset_generators(dataset: Any) -> list[tuple[str, Any]]:
    """``SeededDataset``: :func:`own_generators` of the dataset, each generator once; those of the datasets a torch
    ``Subset`` or ``ConcatDataset`` wraps too, as of a dataset of their own (before, a ``ConcatDataset``'s
    datasets' generators were not found: each sample drew differently every time)."""
    found, ids = [], set()
    inner = [("dataset.", dataset.dataset)] if isinstance(dataset, torch.utils.data.Subset) else \
        [(f"datasets.{i}.", d) for i, d in enumerate(dataset.datasets)] \
        if isinstance(dataset, torch.utils.data.ConcatDataset) else []
    for path, g in own_generators(dataset) + [(f"{p}{q}", g) for p, d in inner for q, g in dataset_generators(d)]:
        if id(g) not in ids:
            ids.add(id(g))
            found.append((path, g))
    return found


def seed_own(seed: int, gens: list[tuple[str, Any]], saved: list[tuple[Any, Any]]) -> None:
    """Seed each ``(path, generator)`` from ``seed`` and its path, appending its state before to ``saved`` (for
    :func:`_put_back`): ``run_seeded`` per sample, ``collategens.CollateSeeder`` per batch (nothing put back)."""
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


def _put_back(saved: list[tuple[Any, Any]]) -> None:
    for g, st in reversed(saved):  # the same generator twice (by two paths): its first state wins
        if isinstance(g, np.random.Generator):
            g.bit_generator.state = st
        elif isinstance(g, random.Random):
            g.setstate(st)
        else:
            g.set_state(st)


_SPAWN_WARNED: set[tuple[str, int]] = set()


def _spawn_counts(gens: list[tuple[str, Any]]) -> list[tuple[str, Any, int]]:
    """``run_seeded``, before each call: the spawn counter of each own NumPy ``Generator``'s ``SeedSequence``."""
    got = []
    for path, g in gens:
        if isinstance(g, np.random.Generator):
            ss = getattr(g.bit_generator, "seed_seq", None)
            if isinstance(ss, np.random.SeedSequence):
                got.append((path, ss, ss.n_children_spawned))
    return got


def _warn_spawned(spawns: list[tuple[str, Any, int]]) -> None:
    """``run_seeded``, after each call: a ``RuntimeWarning`` (once per generator and process) for a NumPy ``Generator``
    whose ``spawn()`` the call used. Seeding sets its bit generator's state, not its ``SeedSequence``'s spawn counter
    (read-only), so the children differ with the samples this process computed before: in each worker, and after a
    resume (before, silently)."""
    for path, ss, n in spawns:
        if ss.n_children_spawned != n and (path, id(ss)) not in _SPAWN_WARNED:
            _SPAWN_WARNED.add((path, id(ss)))
            warnings.warn(
                f"tg.SeededDataset/ResumableIterable(transform=): {path} is a numpy Generator whose spawn() (or "
                "bit_generator.seed_seq.spawn()) a sample used: its children come from a counter that cannot be "
                "seeded, so they differ in each worker and after a resume. Make the sample's generator from the index "
                "(np.random.default_rng([seed, index])) or draw from the generator itself", RuntimeWarning,
                stacklevel=3)


def run_seeded(seed: int, gens: list[tuple[str, Any]], find: Callable[[], list[tuple[str, Any]]],
               fn: Callable[..., Any], *args: Any,
               again: Callable[[], tuple[Any, ...]] | None = None) -> tuple[Any, list[tuple[str, Any]]]:
    """``fn(*args)`` with the global generators and the own generators ``gens`` seeded from ``seed`` (each own one
    from ``seed`` and its path; put back afterwards, in reverse order, also when seeding or ``fn`` raised). The
    global generators are left seeded: the caller saves and restores them (``SeededDataset`` once per batch).
    Returns the result and the own generators found (``find()``) after the call, for the next sample: one whose
    path is new drew unseeded in this call (made on first use), so ``fn`` runs again with it seeded, on the
    arguments ``again()`` gives (``seeded_items``: a copy of the item as it was before the first call, which a
    transform may have changed in place), or on ``args`` again."""
    for _ in range(4):  # a generator made on first use, one more behind it: bounded
        saved: list[tuple[Any, Any]] = []
        spawns = _spawn_counts(gens)
        try:
            seed_own(seed, gens, saved)
            seed_globals(seed)
            out = fn(*args)
        finally:
            _put_back(saved)
        _warn_spawned(spawns)
        after = find()
        if not {p for p, _ in after} - {p for p, _ in gens}:
            return out, after
        gens = after
        if again is not None:
            args = again()
    return out, gens
