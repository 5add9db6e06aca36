"""A module entry whose names differ from the module's by a torch wrapper's prefix: ``module.``
(DDP, ``DataParallel``) or ``_orig_mod.`` (``torch.compile``), on either side.

Who calls: ``stateful.ModuleAdapter`` (``unwrapped_names``, ``load_state_dict``, ``extra_state_diff``),
from ``loader._load`` on every rank, before anything is read and once it is; all three through
:func:`own_names`, so that the paths read into and the names handed to ``load_state_dict`` agree. A
module entry is saved without these prefixes, so they come from elsewhere: ``convert`` of a DDP
``torch.save`` file drops ``module.`` and a model whose own child is named ``module`` (an EMA wrapper)
loads it again (the prefix put back); and a plain dict saved as the entry, ``{"model": ddp.state_dict()}``
or ``{"model": compiled.state_dict()}``, holds them, and loads into the bare module (the prefix dropped).
Before review58b the second was refused (``the checkpoint holds each of the state's 4 tensors under
'_orig_mod.' + its name``) with advice that no existing checkpoint could follow: a compiled module is
unwrapped for the load, and a child named ``_orig_mod`` is refused.

A wrapper prefixes every name with the same string, one component per wrapper: review58e drops only the
leading components that all the checkpoint's names share, as many as match the module best (fewest on a
tie). Before, every leading ``module.``/``_orig_mod.`` of each name was dropped: a DDP-wrapped model with
its own child ``module`` (``module.module.fc.weight``) was read into the bare model's ``fc.weight``, not
its ``module.fc.weight``; and a partial match cost one set of all names per tensor (quadratic).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

PREFIXES = ("module.", "_orig_mod.")


def strip(name: str) -> str:
    """``name`` without its leading wrapper prefixes (``module._orig_mod.fc.weight`` -> ``fc.weight``)."""
    while name.startswith(PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _common_prefixes(saved: list[str]) -> list[str]:
    """The leading wrapper prefixes every name of ``saved`` shares, shortest first
    (``["module.", "module._orig_mod."]``), each leaving a name behind."""
    out, head, rest = [], "", saved[0]
    while rest.startswith(PREFIXES):
        part, rest = rest.split(".", 1)
        head += part + "."
        if not all(n.startswith(head) and len(n) > len(head) for n in saved):
            break
        out.append(head)
    return out


def own_names(saved: list[str], own: Collection[str]) -> dict[str, str] | None:
    """The checkpoint's names ``saved`` (one module entry's, without the entry) -> the module's names
    ``own`` that take them, when they differ by a wrapper prefix; None when the names are to be taken as
    they are. ``module.`` added: the checkpoint's names are exactly ``own`` without it (``convert`` of a DDP
    file, loaded into an EMA wrapper). Dropped: the prefix all of ``saved`` share, cut where most of them
    are the module's, and more than as they are; none when a name of the module not taken so is itself one
    of the checkpoint's (it would be read twice). Linear in the names (times the prefix's components)."""
    if not saved or not all(type(n) is str for n in saved):
        return None
    own = own if isinstance(own, (set, frozenset, dict)) else set(own)
    as_is = sum(n in own for n in saved)
    if not as_is and len(own) == len(saved) and all("module." + n in own for n in saved):
        return {n: "module." + n for n in saved}
    best, hits = "", as_is
    for head in _common_prefixes(saved):
        h = sum(n[len(head):] in own for n in saved)
        if h > hits:
            best, hits = head, h
    if not best:
        return None
    out = {n: n[len(best):] for n in saved}
    taken, names = set(out.values()), set(saved)
    if any(o in names and o not in taken for o in own):
        return None
    return out


def keyed(refs: list[str], dest: dict[str, Any], head: str) -> dict[str, Any]:
    """``dest`` (path -> the state's tensor) keyed by the checkpoint's paths ``refs`` where
    :func:`own_names` matches them by a wrapper prefix (the module's other tensors stay under their
    names, missing from the checkpoint, and the checkpoint's others unexpected); else ``dest``."""
    m = own_names([p[len(head):] for p in refs], {q[len(head):] for q in dest}) if refs else None
    if m is None:
        return dest
    out = {head + p: dest[head + q] for p, q in m.items() if head + q in dest}  # a layer added since (strict=False): missing
    taken = {head + q for q in m.values()}
    out.update((q, t) for q, t in dest.items() if q not in taken)
    return out


def to_module(state_dict: Mapping[str, Any], actual: Mapping[str, str]) -> Mapping[str, Any]:
    """The loaded values keyed as the module's ``actual`` names (canonical -> its own) take them,
    as :func:`keyed` matched them (the module lacks some: they stay unexpected, strict=False)."""
    m = own_names(list(state_dict), actual)
    return state_dict if m is None else {m[k]: v for k, v in state_dict.items()}
