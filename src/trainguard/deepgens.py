"""Generators kept deeper than ``owngens.own_generators`` looks at each sample: in a list, tuple or dict
(``self.rngs = [np.random.default_rng(i) for i in range(2)]``, a ``collections.deque``, or behind a ``weakref.ref``),
or in the transforms a ``Compose`` or an
``nn.Sequential`` holds (``self.transform.transforms[0].rng``). ``SeededDataset.__init__`` (in the training
process, where it is built) and ``seeded.seeded_items`` (once per iterator, in the process that iterates)
walk the object once with :func:`deep_paths`; at each sample :func:`resolve` follows the remembered paths
again (a transform replaced meanwhile: its generator at that path is seeded), reading ``__dict__``, ``__slots__`` and list,
tuple, deque and dict items only (no code of the dataset runs). A generator that appears deeper only after the walk is
not found; generators in a ``set`` or ``frozenset`` are warned about (no order the same in every process to give each
a seed of its own) and not seeded."""

from __future__ import annotations

import collections
import functools
import types
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from .owngens import _kind, closure_cells, instance_attrs

# ("a", attribute name), ("i", list, tuple or deque index), ("k", dict key), ("r", a weakref.ref's referent), and from
# a transform function: ("c", closure variable), ("p", a functools.partial's argument index), ("w", its keyword),
# ("m", a bound method's object)
Step = tuple[str, Any]
_ATOMS = (str, bytes, bytearray, int, float, complex, type(None), torch.Tensor, np.ndarray, np.generic,
          types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, range)
_MAX_LEN = 256  # a container longer than this (the sample list, a vocabulary) is not looked into
_MAX_DEPTH = 6
_MAX_VISITS = 20000
_MISSING = object()


def _children(obj: Any) -> list[tuple[Step, Any]]:
    if isinstance(obj, types.FunctionType):  # the root only (a transform=): its closure variables
        return [(("c", k), v) for k, v in sorted(closure_cells(obj).items())]
    if isinstance(obj, types.MethodType):  # transform=self.augment, [aug.apply]: its object
        return [(("m", "self"), obj.__self__)]
    if isinstance(obj, functools.partial):
        return [(("p", i), v) for i, v in enumerate(obj.args)] + [(("w", k), v) for k, v in sorted(obj.keywords.items())]
    if isinstance(obj, list | tuple | collections.deque):  # a deque: as a list (before, never looked into)
        return [(("i", i), v) for i, v in enumerate(obj)] if len(obj) <= _MAX_LEN else []
    if type(obj) is weakref.ref or type(obj) is weakref.WeakMethod:  # self.rng_ref = weakref.ref(g): its referent
        got = obj()
        return [] if got is None else [(("r", "ref"), got)]
    if isinstance(obj, dict):
        if len(obj) > _MAX_LEN:
            return []
        keys = [k for k in obj if type(k) in (str, int)]
        return [(("k", k), obj[k]) for k in sorted(keys, key=lambda k: (type(k) is str, k))]
    return [(("a", k), v) for k, v in sorted(instance_attrs(obj).items())]


def name(steps: tuple[Step, ...]) -> str:
    """A path's name, ``transform.transforms.0.rng`` (its generator's seed is drawn from it)."""
    return ".".join(str(k) for _, k in steps)


def deep_paths(root: Any, known: set[int], where: str | None) -> tuple[tuple[Step, ...], ...]:
    """The paths from ``root`` to the generators not in ``known`` (ids of those found each sample), breadth
    first (the shortest path to each, in a fixed order), at most ``_MAX_DEPTH`` objects down. A ``SeedSequence``
    found on the way is warned about (``where`` names the object; ``None``: not again): its ``spawn()`` counter
    cannot be set back."""
    out: list[tuple[Step, ...]] = []
    seen, gens = {id(root)}, set(known)
    queue = collections.deque([(root, (), 0)])
    visits = 0
    while queue and visits < _MAX_VISITS:
        obj, steps, depth = queue.popleft()
        visits += 1
        for step, value in _children(obj):
            path = (*steps, step)
            if _kind(value):
                if id(value) not in gens:
                    gens.add(id(value))
                    out.append(path)
            elif isinstance(value, set | frozenset) and where is not None and any(_kind(v) for v in value):
                warnings.warn(f"{where}: {name(path)} is a {type(value).__name__} of generators; a set has no order "
                              "that is the same in every process, so its generators cannot each get a seed of their "
                              "own and are not seeded: a resume draws differently. Keep them in a list or a dict, or "
                              "as attributes", RuntimeWarning, stacklevel=3)
            elif isinstance(value, np.random.SeedSequence) and where is not None:
                warnings.warn(f"{where}: {name(path)} is a numpy SeedSequence; its spawn() gives other seeds in each "
                              "worker and after a resume, and it cannot be seeded per sample: derive the sample's "
                              "generator from the index (np.random.default_rng([seed, index])) or draw from a "
                              "generator kept as an attribute", RuntimeWarning, stacklevel=3)
            elif not isinstance(value, _ATOMS) and id(value) not in seen and depth < _MAX_DEPTH \
                    and not isinstance(value, np.random.BitGenerator):
                seen.add(id(value))
                queue.append((value, path, depth + 1))
    return tuple(out)


def resolve(root: Any, paths: tuple[tuple[Step, ...], ...]) -> list[tuple[str, Any]]:
    """``(name, generator)`` for each remembered path that still leads to a generator (every sample)."""
    found = []
    for steps in paths:
        obj = root
        for kind, key in steps:
            if kind == "a":
                obj = instance_attrs(obj).get(key, _MISSING)
            elif kind == "m":
                obj = obj.__self__ if isinstance(obj, types.MethodType) else _MISSING
            elif kind == "c":
                obj = closure_cells(obj).get(key, _MISSING) if isinstance(obj, types.FunctionType) else _MISSING
            elif kind == "p":
                obj = obj.args[key] if isinstance(obj, functools.partial) and key < len(obj.args) else _MISSING
            elif kind == "w":
                obj = obj.keywords.get(key, _MISSING) if isinstance(obj, functools.partial) else _MISSING
            elif kind == "i":
                obj = obj[key] if isinstance(obj, list | tuple | collections.deque) and key < len(obj) else _MISSING
            elif kind == "r":
                obj = obj() if type(obj) is weakref.ref or type(obj) is weakref.WeakMethod else _MISSING
                obj = _MISSING if obj is None else obj
            else:
                obj = dict.get(obj, key, _MISSING) if isinstance(obj, dict) else _MISSING
            if obj is _MISSING:
                break
        if obj is not _MISSING and _kind(obj):
            found.append((name(steps), obj))
    return found
