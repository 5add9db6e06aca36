"""Refusals of an entry's saved state that its ``load_state_dict`` would make only after the load
had read the other entries' bytes into the state.

``loader._load`` reads every tensor in place first and calls each entry's ``load_state_dict``
last, so an entry refused there left the model, the optimizer and the entries before it loaded
and the others not: a ``CheckpointError`` over a half-loaded state (seen: an enabled
``GradScaler`` against a checkpoint saved with it disabled, a ``ResumableSampler`` of another
dataset length, a ``PowerSGDState`` of another rank, whose ``iter`` was set before the refusal too). These
refusals depend on the saved JSON values alone, so :func:`before_read`
(called by ``loader._load`` on every rank, for each entry, while it plans the load) makes them
before anything is read, as the optimizer's and the scheduler's class checks are made; on
several ranks the load's first round then raises on every rank with the state as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError
from .flatten import unflatten
from .sampler import ResumableIterable
from .scalerstate import keeps_fresh


def before_read(key: str, obj: Any, skel: Any, strict: bool) -> None:
    """Raise the refusal that ``obj.load_state_dict`` would raise for the saved skeleton ``skel`` of
    entry ``key``, when it is known from the skeleton's JSON values: an enabled ``GradScaler``
    against a disabled one's empty state (``strict`` only: ``strict=False`` keeps it fresh, with a
    warning, at the load's end, ``scalerstate.keeps_fresh``); an object with ``check_saved_state``
    (``ResumableSampler``: another dataset length or ``shuffle``; a DDP comm hook's state,
    ``commhooks.HookStateAdapter``: another hook, another ``matrix_approximation_rank``), given the
    saved values with None for each tensor; a ``ResumableIterable`` given a sampler's state."""
    check = getattr(obj, "check_saved_state", None)
    scaler, iterable = strict and isinstance(obj, torch.amp.GradScaler), isinstance(obj, ResumableIterable)
    if not (scaler or iterable or callable(check)) or not isinstance(skel, dict):
        return
    try:
        saved = unflatten(skel, lambda p: None)  # JSON values alone: None for each tensor
        if not isinstance(saved, dict):
            return
        if callable(check):
            try:
                check(saved)
            except (KeyError, TypeError, ValueError):  # a malformed state: its load_state_dict says so, as before
                pass
        if scaler:
            keeps_fresh(key, obj, saved, strict)
        if iterable and "num_samples" in saved:
            obj.load_state_dict(saved)  # refuses a sampler's state before it changes anything
    except CheckpointError as e:
        if e.args and isinstance(e.args[0], str) and not e.args[0].startswith("entry "):
            e.args = (f"entry {key!r}: {e.args[0]}", *e.args[1:])
        raise
