"""``trainguard inspect``: the plain values of each entry (a sampler's position, the progress
counters, a scheduler's state, an optimizer's ``param_groups``), beside its tensors. Before, the
tree showed tensors only: ``data`` and ``progress`` were bare names, and a user checking where a
resume would go on had to parse ``manifest.json`` by hand (session 49)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

_TENSOR = object()  # stands for each tensor while a skeleton is decoded
CLIP = 200  # characters of an entry's values on inspect's text line


def _has_tensor(v: Any) -> bool:
    if v is _TENSOR:
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def entry_values(m: Any) -> dict[str, Any]:
    """Per entry of the manifest ``m`` (rank 0's copy of a per-rank one), the values of its skeleton
    that hold no tensor: a dict of the top-level keys whose value holds none, or the entry's
    value itself when it is a plain one. Entries without such values are left out."""
    from ..skeleton import unflatten  # when inspect runs, not by `trainguard --help`

    out: dict[str, Any] = {}
    for key, obj in m.objects.items():
        skel = obj.get("skeleton") if "skeleton" in obj else (obj["ranks"][0] if obj["ranks"] else None)
        try:
            value = unflatten(skel, lambda p: _TENSOR, where=f"{key}")
        except CorruptCheckpointError:
            continue
        if isinstance(value, dict):
            plain = {k: v for k, v in value.items() if not _has_tensor(v)}
            if plain:
                out[key] = plain
        elif value is not None and not _has_tensor(value):
            out[key] = value
    return out


def shown(value: Any) -> str:
    """One entry's values as inspect's text line shows them: ``key=value, ...``, cut at ``CLIP``."""
    text = ", ".join(f"{k}={v!r}" for k, v in value.items()) if isinstance(value, dict) else repr(value)
    return text if len(text) <= CLIP else f"{text[:CLIP]}... ({len(text)} characters)"
