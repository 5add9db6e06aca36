"""Nested state <-> a JSON skeleton plus a flat ``{path: tensor}`` map. Pure; no I/O.

A state value is a tree of dicts, lists and tuples whose leaves are tensors or JSON values
(int, float incl. nan/inf, bool, None, str). :func:`flatten` turns it into

* a *skeleton*: plain JSON that mirrors the tree, with each tensor replaced by
  ``{"$t": "<path>"}``, and the things JSON cannot say encoded as one-key objects:
  ``{"$tuple": [...]}``, ``{"$float": "nan"|"inf"|"-inf"}``,
  ``{"$dict": [[key, value], ...]}`` for dicts whose keys are not all plain strings
  (int keys, or keys starting with ``$``);
* ``tensors``: ``{path: tensor}`` in tree order, paths joined with ``/``
  (``optim/state/fc.weight/exp_avg``).

:func:`unflatten` (in :mod:`.skeleton`, torch-free, re-exported here) reverses it, taking
tensors from a mapping. Anything that is neither a tensor nor JSON raises
:class:`UnsupportedValueError` naming its path, at save time.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter as _LoaderIter

from . import genstate
from .errors import UnsupportedValueError
from .skeleton import (  # noqa: F401  (the reading side, torch-free: imported from here by many modules)
    MAX_DEPTH,
    decode_json,
    loads_json,
    single_tensor,
    tensor_refs,
    unflatten,
    unique_keys,
)

# Python's default limit on the decimal digits of an int that ``json`` reads or writes
# (``sys.int_info.default_max_str_digits``): a larger int saved with the limit raised would
# make the manifest unreadable, "invalid JSON", to any process with the default.
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS


def _plain_key(k: object) -> bool:
    return type(k) is str and not k.startswith("$")


def _enum_hint(v: enum.Enum) -> str:
    """What to save in place of enum member ``v``: its value or name, and how to get the member back."""
    cls = type(v).__qualname__
    return (f"save its .value ({repr(v.value)[:40]}) or .name ({v.name!r}) and turn it back into the member after "
            f"the load ({cls}(value) or {cls}[name]): an Enum is not saved itself, as loading it would import "
            "its class by name (what pickle does)")


def flatten(value: Any, prefix: str, *, deques: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(skeleton, tensors)`` for one state value rooted at ``prefix``.

    A ``collections.deque`` is stored as a list (:func:`keep_types` gives it back, with the
    destination's ``maxlen``, to a load in place that finds one there). ``deques=False``
    (``capture.capture``, an optimizer or module entry: their ``load_state_dict`` rebuilds what it
    is given and would keep a list, without ``maxlen``) refuses it."""
    if isinstance(value, torch.Tensor):  # a state that is a flat dict of tensors: one call per tensor
        return {"$t": prefix}, {prefix: value}
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, torch.Tensor):
            if path in tensors:
                raise UnsupportedValueError(
                    f"{path}: two tensors map to the same path: a key contains '/', or an int key and a str key "
                    "read alike (1 and '1'); rename the keys"
                )
            tensors[path] = v
            return {"$t": path}
        if v is None or type(v) is bool or type(v) is str:
            return v
        if type(v) is int:
            return _check_int(v, path)
        if type(v) is float or type(v).__module__ == "numpy" and isinstance(v, float):
            v = float(v)  # numpy.float64 (a float subclass): an lr set by a manual schedule, np.cos(...)
            if math.isfinite(v):
                return v
            return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, Mapping):
            # _plain_key for each key, spelt out: a call per key was a third of flattening an optimizer's state
            if all(type(k) is str and k[:1] != "$" for k in v):
                return {k: enc(x, f"{path}/{k}", depth + 1) for k, x in v.items()}
            pairs = []
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise UnsupportedValueError(
                        f"{path}: dict key {k!r} of type {type(k).__name__} is not supported; "
                        f"use str or int keys{'; ' + _enum_hint(k) if isinstance(k, enum.Enum) else ''}"
                    )
                if type(k) is int:
                    _check_int(k, path)
                pairs.append([k, enc(x, f"{path}/{k}", depth + 1)])
            return {"$dict": pairs}
        if type(v) is tuple:
            return {"$tuple": [enc(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]}
        if type(v) is list or type(v) is deque and deques:
            return [enc(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]
        if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            # A module, optimizer or scheduler inside an entry ({"models": {"gen": G}}): only
            # top-level entries are adapted (module prefixes, optimizers keyed by name).
            raise UnsupportedValueError(
                f"{path}: a {type(v).__module__}.{type(v).__qualname__} inside an entry cannot be saved; objects "
                "with state_dict()/load_state_dict() (modules, optimizers, schedulers...) are saved as top-level "
                f"entries of the state only: give it its own key, e.g. state[{path.replace('/', '.')!r}]"
            )
        if genstate.kind_of(v) is not None:  # torch.Generator, NumPy's, random.Random
            hint = ("a random generator is saved by tg.RNGState(generators={'name': g}) (per rank, with the global "
                    "ones; docs/checkpoints.md)")
        elif isinstance(v, (torch.utils.data.DataLoader, torch.utils.data.Sampler, _LoaderIter)):
            hint = ("a DataLoader's position is saved by its sampler: use tg.ResumableSampler (map-style datasets) or "
                    "tg.ResumableIterable (iterable ones) and save that as an entry (docs/data.md)")
        elif (has := [m for m in ("state_dict", "load_state_dict") if callable(getattr(v, m, None))]) or \
                any(hasattr(type(v), m) for m in ("state_dict", "load_state_dict")):  # half the protocol, or a property
            lacks = [f"{m}()" for m in ("state_dict", "load_state_dict") if m not in has]
            hint = (f"it has {' and '.join(f'{m}()' for m in has) or 'state_dict/load_state_dict, not as methods'} but "
                    f"no {' or '.join(lacks)} method: an object saved by trainguard needs both (its load calls "
                    "load_state_dict with what state_dict() returned)")
        elif isinstance(v, enum.Enum):  # rebuilding it on load would import its class by name: what pickle does
            hint = _enum_hint(v)
        elif hasattr(v, "item") or hasattr(v, "tolist"):  # numpy scalars and number-likes: a common accident
            hint = "convert it with int()/float()/.tolist()"
        else:
            hint = (
                "store tensors or JSON values (int, float, bool, None, str, dict, list, tuple); "
                "wrap other objects in a class with state_dict()/load_state_dict() returning those"
            )
        raise UnsupportedValueError(
            f"{path}: value of type {type(v).__module__}.{type(v).__qualname__} cannot be saved "
            f"without pickle; {hint}"
        )

    try:
        return enc(value, prefix, 0), tensors
    finally:
        enc = None  # type: ignore[assignment]  # break enc -> cell -> enc: no garbage cycle per call


def _check_int(v: int, path: str) -> int:
    """``flatten``: ``v``, or refused when it has more decimal digits than JSON can carry back."""
    if -_INT_BOUND < v < _INT_BOUND:
        return v
    raise UnsupportedValueError(
        f"{path}: an int of {v.bit_length()} bits has more than {MAX_INT_DIGITS} decimal digits, which "
        "Python's json does not read back; store it as hex(v) and convert it back with int(s, 16)"
    )


def keep_types(loaded: Any, current: Any) -> Any:
    """``loaded`` (what :func:`unflatten` built) with each dict that ``current`` holds at the
    same place as a ``Counter``, ``OrderedDict`` or ``defaultdict`` made one again (with its
    ``default_factory``), each list as a ``deque`` (with its ``maxlen``) and each float as a
    ``numpy.float64``. A skeleton stores every dict as a dict; ``loader._load`` calls this
    with the destination's own ``state_dict()`` (or value), so a load in place keeps its types:
    a ``MultiStepLR``'s milestones are a ``Counter``, and ``SequentialLR`` needs its
    ``.elements()`` at its switch. Dicts and lists are changed in place (they are fresh)."""
    if type(loaded) is dict and isinstance(current, dict):
        for k, v in loaded.items():
            if k in current and (w := keep_types(v, current[k])) is not v:
                loaded[k] = w  # an existing key: no resize while iterating
        typ = type(current)
        if type(current) is defaultdict:
            return defaultdict(current.default_factory, loaded)
        return typ(loaded) if typ in (Counter, OrderedDict) else loaded
    if type(loaded) is float:  # a user scheduler's attribute set from numpy (flatten stores a float)
        return type(current)(loaded) if type(current).__module__ == "numpy" and isinstance(current, float) else loaded
    if type(loaded) is list and type(current) is deque:  # a user scheduler's window of recent values
        # Its elements too, where the destination holds one at the same place (a deque of deques).
        return deque([*(keep_types(v, c) for v, c in zip(loaded, current)), *loaded[len(current):]], maxlen=current.maxlen)
    if type(loaded) in (list, tuple) and type(current) is type(loaded):
        new = [keep_types(v, c) for v, c in zip(loaded, current)]
        if any(w is not v for w, v in zip(new, loaded)):
            if type(loaded) is tuple:
                return (*new, *loaded[len(new):])
            loaded[: len(new)] = new
    return loaded


def encode_json(value: Mapping[str, Any], where: str = "metadata") -> Any:
    """A checkpoint's ``metadata`` as it is stored in the manifest (JSON, nan/inf and tuples
    marked as in skeletons). ``api._collective_capture`` calls it on every rank before anything is written, so a
    value that cannot be stored fails the call, not the commit; ``Manifest.to_bytes`` again."""
    skel, tensors = flatten(dict(value), where)
    if tensors:
        raise UnsupportedValueError(
            f"{next(iter(tensors))}: metadata cannot hold tensors; convert it with .item() or .tolist()"
        )
    return skel


def same_values(loaded: Any, current: Any) -> bool:
    """``loader._load``: whether a read-only state already holds what was loaded (a tensor loaded in place, an equal
    value), compared leaf by leaf: ``==`` on a structure would take ``True`` for ``1`` and a new
    one-element tensor (another dtype or shape) for the state's, and drop what was loaded."""
    if loaded is current:
        return True
    if type(loaded) is not type(current) or isinstance(loaded, torch.Tensor):
        return False
    if isinstance(loaded, dict):
        return loaded.keys() == current.keys() and all(same_values(v, current[k]) for k, v in loaded.items())
    if isinstance(loaded, (list, tuple)):
        return len(loaded) == len(current) and all(same_values(a, b) for a, b in zip(loaded, current, strict=True))
    return bool(loaded == current) or (loaded != loaded and current != current)  # JSON leaves; nan holds nan


def refill(current: Any, loaded: Any) -> Any:
    """``current`` given ``loaded``'s values in place where both are dicts (or lists, deques with the
    same ``maxlen``), nested ones too, and returned; else ``loaded``. ``loader._load`` puts the result in
    the state for a plain entry, and ``StateDict.load_state_dict`` fills itself with it: a script's own
    reference to the entry's dict (``progress = {"step": 0}``, ``state = {"progress": progress}``)
    sees the load, as a module's tensors do. Before session 56 the entry was replaced by a new dict,
    and ``progress["step"]`` stayed 0 after a restore, silently. A tensor loaded in place is already
    ``current``'s; one whose shape or dtype changed (read into a new tensor) replaces it, as documented."""
    if loaded is current:
        return current
    if isinstance(current, dict) and isinstance(loaded, dict):
        new = {k: refill(current[k], v) if k in current else v for k, v in loaded.items()}
        current.clear()
        current.update(new)
        return current
    if (type(current) is list and type(loaded) is list) or (
            type(current) is deque and type(loaded) is deque and current.maxlen == loaded.maxlen):
        new = [refill(c, v) for c, v in zip(current, loaded)] + list(loaded)[len(current):]
        current.clear()
        current.extend(new)
        return current
    return loaded
