"""A checkpoint's JSON read back: skeletons (:func:`unflatten`, :func:`tensor_refs`), the
manifest's and an index's JSON (:func:`loads_json`), the metadata (:func:`decode_json`). No torch:
``manifest.parse`` validates with these, so ``trainguard ls``, ``inspect`` and ``verify`` read a
checkpoint without importing torch; :mod:`.flatten` (which writes skeletons, with torch) re-exports
every name here. The skeleton's format is described in :mod:`.flatten`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import CorruptCheckpointError

# Deepest nesting accepted when reading a skeleton back (hostile manifests).
MAX_DEPTH = 64


def unflatten(skeleton: Any, get_tensor: Callable[[str], Any], *, where: str = "manifest") -> Any:
    """Rebuild the value from its skeleton; ``get_tensor(path)`` supplies each tensor.

    Validates as it goes: a malformed skeleton raises :class:`CorruptCheckpointError`.
    """

    def dec(s: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: skeleton nested deeper than {MAX_DEPTH} levels")
        if s is None or type(s) in (bool, int, float, str):
            return s
        if type(s) is list:
            return [dec(x, depth + 1) for x in s]
        if type(s) is dict:
            if len(s) == 1:
                (k, x), = s.items()
                if k == "$t":
                    if type(x) is not str:
                        raise CorruptCheckpointError(f"{where}: tensor reference {str(x)[:80]!r} is not a string")
                    return get_tensor(x)
                if k == "$tuple":
                    if type(x) is not list:
                        raise CorruptCheckpointError(f"{where}: $tuple holds {type(x).__name__}, not a list")
                    return tuple(dec(y, depth + 1) for y in x)
                if k == "$float":
                    if x not in ("nan", "inf", "-inf"):
                        raise CorruptCheckpointError(f"{where}: bad $float {str(x)[:40]!r}")  # cut, as every quoted value
                    return float(x)
                if k == "$dict":
                    if type(x) is not list:
                        raise CorruptCheckpointError(f"{where}: $dict holds {type(x).__name__}, not a list")
                    out = {}
                    for pair in x:
                        if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (str, int):
                            raise CorruptCheckpointError(f"{where}: bad $dict item {str(pair)[:80]!r}")
                        out[pair[0]] = dec(pair[1], depth + 1)
                    return out
            for k in s:
                if k.startswith("$"):
                    raise CorruptCheckpointError(f"{where}: unknown skeleton marker {k[:40]!r}")
            return {k: dec(x, depth + 1) for k, x in s.items()}
        raise CorruptCheckpointError(f"{where}: unexpected skeleton value of type {type(s).__name__}")

    try:
        return dec(skeleton, 0)
    finally:
        dec = None  # type: ignore[assignment]  # break dec -> cell -> dec: no garbage cycle per call


def single_tensor(skel: Any) -> str | None:
    """The path when ``skel`` is one tensor reference, ``{"$t": path}`` (an entry that is a
    tensor: a flat dict of tensors has thousands), else None. The loader and the manifest's
    validation take a shortcut for these instead of walking the skeleton."""
    if type(skel) is dict and len(skel) == 1:
        p = skel.get("$t")
        if type(p) is str:
            return p
    return None


def tensor_refs(skeleton: Any) -> list[str]:
    """All tensor paths referenced by a skeleton, in order (no validation beyond shape)."""
    out: list[str] = []
    stack = [skeleton]
    while stack:
        s = stack.pop()
        if type(s) is list:
            stack.extend(reversed(s))
        elif type(s) is dict:
            if (p := single_tensor(s)) is not None:
                out.append(p)
            else:
                stack.extend(reversed(list(s.values())))
    return out


def decode_json(skel: Any, where: str) -> Any:
    """Inverse of :func:`.flatten.encode_json` (``manifest.parse``); a tensor reference there is corrupt."""

    def no_tensor(path: str) -> Any:
        raise CorruptCheckpointError(f"{where}: metadata refers to a tensor ({path[:60]!r})")

    return unflatten(skel, no_tensor, where=where)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's ``object_pairs_hook`` for a manifest or an index (``loads_json``, retention's
    ``_leading_fields``): an object naming one key twice is refused (ValueError), not read as its
    last value (``json.loads``), which let a hand-edited manifest describe a tensor, a file or an
    entry twice and load the second silently; ``json.dumps`` of a dict never writes one."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice[:80]!r} appears twice in one object (a corrupt or hand-edited file)")
    return out


def loads_json(data: bytes) -> Any:
    """``json.loads`` of standard JSON only (``manifest.parse``, ``index``): the ``NaN`` and
    ``Infinity`` literals that ``json.loads`` accepts are never written (``allow_nan=False``;
    non-finite floats are ``{"$float": ...}``), and one in a skeleton could not be written back
    (``consolidate``); nor is a key twice in one object (:func:`unique_keys`)."""
    return json.loads(data, parse_constant=_no_constant, object_pairs_hook=unique_keys)
