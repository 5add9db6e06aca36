"""A module entry whose names differ from the module's by a torch wrapper's prefix: ``module.``
(DDP, ``DataParallel``) or ``_orig_mod.`` (``torch.compile``), on either side.

Who calls: ``stateful.ModuleAdapter`` (``unwrapped_names``, ``load_state_dict``, ``extra_state_diff``),
from ``loader._load`` on every rank, before anything is read and once it is. A module entry is saved
without these prefixes, so they come from elsewhere: ``convert`` of a DDP ``torch.save`` file drops
``module.`` and a model whose own child is named ``module`` (an EMA wrapper) loads it again (the
prefix put back); and a plain dict saved as the entry, ``{"model": ddp.state_dict()}`` or
``{"model": compiled.state_dict()}``, holds them, and loads into the bare module (the prefix dropped).
Before review58b the second was refused (``the checkpoint holds each of the state's 4 tensors under
'_orig_mod.' + its name``) with advice that no existing checkpoint could follow: a compiled module is
unwrapped for the load, and a child named ``_orig_mod`` is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIXES = ("module.", "_orig_mod.")


def strip(name: str) -> str:
    """``name`` without its leading wrapper prefixes (``module._orig_mod.fc.weight`` -> ``fc.weight``)."""
    while name.startswith(PREFIXES):
        name = name.split(".", 1)[1]
    return name


def keyed(refs: list[str], dest: dict[str, Any], head: str) -> dict[str, Any]:
    """``dest`` (path -> the state's tensor) keyed by the checkpoint's paths ``refs`` when those are
    exactly the module's own without its leading ``module.``, or when every one of them carries wrapper
    prefixes and, without them, some are the module's (those are keyed so; the module's others stay under
    their names, missing from the checkpoint, and the checkpoint's others unexpected); else ``dest``."""
    if not refs or any(p in dest for p in refs):
        return dest
    w = head + "module."
    if all(p.startswith(w) for p in dest):
        alias = {p: w + p[len(head) :] for p in refs}
        if set(alias.values()) == set(dest):
            return {p: dest[q] for p, q in alias.items()}
    alias = {p: head + strip(p[len(head) :]) for p in refs}
    if all(p != q for p, q in alias.items()) and len(set(alias.values())) == len(refs) and any(q in dest for q in alias.values()):
        out = {p: dest[q] for p, q in alias.items() if q in dest}  # a layer added since (strict=False): missing as usual
        out.update((q, t) for q, t in dest.items() if q not in set(alias.values()))
        return out
    return dest


def to_module(state_dict: Mapping[str, Any], actual: Mapping[str, str]) -> Mapping[str, Any]:
    """The loaded values keyed as the module's ``actual`` names (canonical -> its own) take them,
    when :func:`keyed` matched them by a wrapper prefix."""
    if not state_dict or any(k in actual for k in state_dict):
        return state_dict
    if all("module." + k in actual for k in state_dict):
        return {"module." + k: v for k, v in state_dict.items()}
    stripped = {strip(k): v for k, v in state_dict.items()}
    if len(stripped) == len(state_dict) and all(k not in state_dict for k in stripped) and any(k in actual for k in stripped):
        return stripped  # those the module lacks stay unexpected (strict=False): as keyed() left them
    return state_dict


def same_extra(have: list[str], saved: list[str]) -> bool:
    """Whether the extra-state keys the checkpoint holds (``saved``) are the module's (``have``) but for a
    wrapper prefix, on either side."""
    return set(have) != set(saved) and ({"module." + k for k in saved} == set(have) or {strip(k) for k in saved} == set(have))
