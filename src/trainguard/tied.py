"""Tied storage written once (format 3): a tensor that one rank's state holds under several
names (a GPT's ``lm_head.weight`` IS ``wte.weight``: two ``state_dict()`` keys, one tensor).

Save: ``capture`` notes, for each plain tensor (``torch.Tensor``/``nn.Parameter``, not DTensor
shards nor rank-local entries), where its memory starts (one dict lookup per tensor). A later
name that is the same view of the same memory as an earlier one (same address, dtype, shape,
stride, device, conjugate and negative bits) becomes an alias leaf: nobody writes it, and the
manifest describes it as ``{"dtype", "shape", "alias": "<the earlier name>"}``. Views that only
overlap (``base`` and ``base[2:8]``) are saved separately, as before; ``x.conj()`` of a complex
``x`` earlier in the state is no tie (its memory is ``x``'s, its values are not): ``_leaf`` refuses it.

Manifest: :func:`parse_alias` checks an alias entry's own fields and :func:`resolve_aliases`
its target (``manifest.validate`` calls both), then gives the alias its target's ``chunks``
list: every reader (load, partial loads, resharding, export) reads an alias through its
target's bytes and checksums without knowing about aliases. What walks *all* chunks of a
manifest once (byte-range checks, ``verify``, ``consolidate``) skips alias entries, which hold
no bytes of their own. :func:`format_for` keeps checkpoints without a tie at format 1 (2 with
regular tensors), readable by older trainguard; a format 3 one makes them say "upgrade".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

    from .manifest import TensorEntry

    PLAIN: tuple[type, ...]  # bound by __getattr__ below

MAX_PATH = 4096


def __getattr__(name: str) -> Any:
    """PEP 562: ``PLAIN``, the types whose ties are detected (``type(t) in PLAIN``: ``capture``, ``stage``), is
    torch's: bound at its first use, not when ``manifest`` imports this module without torch (``trainguard ls``)."""
    if name == "PLAIN":
        import torch

        globals()["PLAIN"] = plain = (torch.Tensor, torch.nn.Parameter)
        return plain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sig(t: torch.Tensor) -> tuple[Any, ...]:
    # What makes two tensors at the same address the same view (x.conj(): x's memory, other values).
    return (t.dtype, t.shape, t.stride(), t.device, t.is_conj(), t.is_neg())


def same_view(hit: Any, t: torch.Tensor) -> Any:
    """``capture``: the leaf of the earlier tensor that is the same view as ``t``, else None.
    ``hit``: what :func:`remember` keeps for ``t``'s address. A leaf whose path is longer than
    :func:`parse_alias` takes as a target is none: ``t`` is then saved with bytes of its own."""
    if not t.numel():
        return None
    if type(hit) is dict:
        found = hit.get(_sig(t))
        return None if found is None else found[1]
    u, leaf = hit
    return leaf if len(leaf.path) <= MAX_PATH and _sig(u) == _sig(t) else None


def remember(seen: dict[int, Any], ptr: int, t: torch.Tensor, leaf: Any) -> None:
    """``capture``: note that ``t`` (saved as ``leaf``) starts at address ``ptr``. One tensor
    is kept as ``(t, leaf)``; several views starting there as a dict by view (the first of each
    view), so that thousands of views of one buffer (``base[:i]``) cost O(1) each, not a scan of
    the earlier ones. Every tensor stays referenced until the capture ends (no address reused)."""
    hit = seen.get(ptr)
    if hit is None:
        seen[ptr] = (t, leaf)
        return
    if type(hit) is not dict:
        seen[ptr] = hit = {None: [hit]} if len(hit[1].path) > MAX_PATH else {_sig(hit[0]): hit}
    if len(leaf.path) <= MAX_PATH and t.numel():
        hit.setdefault(_sig(t), (t, leaf))
    else:
        hit.setdefault(None, []).append((t, leaf))


def format_for(tensors: Iterable[TensorEntry]) -> int:
    """The format_version a manifest with these entries is written in: 3 with an alias, 2 with a
    regular tensor, else 1 (older trainguard reads what it can)."""
    version = 1
    for e in tensors:
        if e.alias is not None:
            return 3
        if e.regular is not None:
            version = 2
    return version


def parse_alias(t: dict[str, Any], version: int, w: str, where: str, path: str) -> str:
    """An alias entry's own fields (its dtype and shape were checked by the caller)."""
    if version < 3:
        raise CorruptCheckpointError(f"{w}: alias entries need format_version 3, the manifest says {version}", file=where, entry=path)
    target = t["alias"]
    if set(t) != {"dtype", "shape", "alias"}:
        raise CorruptCheckpointError(f"{w}: an alias entry holds no chunks of its own (fields {sorted(t)[:6]})", file=where, entry=path)
    if type(target) is not str or not target or len(target) > MAX_PATH:
        raise CorruptCheckpointError(f"{w}: alias {str(target)[:60]!r} is not a tensor path", file=where, entry=path)
    return target


def resolve_aliases(tensors: Mapping[str, TensorEntry], where: str) -> None:
    """Check each alias's target and give the alias the target's chunks (the same list)."""
    for path, e in tensors.items():
        if e.alias is None:
            continue
        target = tensors.get(e.alias)
        why = None
        if target is None:
            why = "which the manifest does not describe"
        elif target.alias is not None:
            why = f"which is itself an alias (of {target.alias[:80]!r})"
        elif target.regular is not None:
            why = "which is a regular tensor (aliases name tensors with chunks)"
        elif target.dtype != e.dtype or target.shape != e.shape:
            why = f"which is {target.dtype}{target.shape}, the alias {e.dtype}{e.shape}"
        if why:
            raise CorruptCheckpointError(
                f"{where}: tensor {path[:80]!r} is an alias of {e.alias[:80]!r}, {why}", file=where, entry=path
            )
        e.chunks = target.chunks  # type: ignore[union-attr]


def aliases_of(tensors: Mapping[str, TensorEntry]) -> dict[str, list[str]]:
    """Target path -> the paths of its aliases (empty for a checkpoint without ties)."""
    out: dict[str, list[str]] = {}
    for path, e in tensors.items():
        if e.alias is not None:
            out.setdefault(e.alias, []).append(path)
    return out
