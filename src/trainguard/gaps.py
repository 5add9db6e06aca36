"""Keys the state holds that its checkpoint lacks, in an entry that is plain data (a dict of
tensors and JSON values) or a ``tg.StateDict``: a key added since the save, e.g. a new counter in
the progress dict. Other objects' own ``load_state_dict`` decides for them, and modules and
optimizers are compared tensor by tensor (``loader._load``).

``loader._load`` calls :func:`missing` on every rank for each entry before anything is read (a
strict load reports those keys missing, nothing loaded), and :func:`fill` as it hands each
entry its loaded value (``strict=False``: those keys keep their current values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .flatten import unflatten
from .stateful import StateDict, has_state


def _applies(obj: Any) -> bool:
    return not has_state(obj) or isinstance(obj, StateDict)


def missing(obj: Any, current: Any, skel: Any, prefix: str) -> list[str]:
    """The paths (``prefix/key/...``) of the keys in ``current``'s dicts (the state's value, or
    the ``StateDict`` ``obj``'s ``state_dict()``) that the checkpoint's skeleton ``skel`` lacks."""
    out: list[str] = []

    def walk(c: Any, s: Any, path: str) -> None:
        if isinstance(c, Mapping) and type(s) is dict:
            for k, v in c.items():
                if k in s:
                    walk(v, s[k], f"{path}/{k}")
                else:
                    out.append(f"{path}/{k}")

    if _applies(obj) and isinstance(current, Mapping) and current:
        walk(current, unflatten(skel, lambda p: None), prefix)
    return out


def fill(obj: Any, loaded: Any, current: Any) -> Any:
    """``loaded`` with each key of ``current``'s dicts that the checkpoint lacked (:func:`missing`)
    put back with its current value; ``loaded`` as it is for the objects this does not apply to."""
    if _applies(obj) and type(loaded) is dict and isinstance(current, Mapping):
        for k, v in current.items():
            if k in loaded:
                fill(obj, loaded[k], v)
            else:
                loaded[k] = v
    return loaded
