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

from collections.abc import Mapping
from typing import Any

import torch

from .dtypes import DTYPE_NAMES
from .errors import CheckpointError
from .flatten import flatten, unflatten
from .optim_groups import a
from .permanent import mark
from .sampler import ResumableIterable
from .scalerstate import keeps_fresh
from .stateful import has_state


def copy_of_object(key: str, value: Any, skel: Any, manifest: Any) -> None:
    """``loader._load``, every rank, before anything is read: refuse a non-empty plain dict as the
    destination of an entry saved from an optimizer or an LR scheduler (its ``"class"``). Such a dict is
    a copy, ``optimizer.state_dict()`` in the state as a ``torch.save`` script writes it: the load
    filled the copy and left the optimizer (and the scheduler) as it was, silently (seen: a resume
    with Adam's moments and the lr schedule back at their start). An empty dict (``{"optim": {}}``)
    still takes the saved values as plain data, as does ``get_state_dict``'s (parameters by name:
    :func:`_by_name`). A module's entry (``"frozen"`` beside it) loads into ``model.state_dict()`` in place, its tensors being the module's; one of another shape or dtype was
    replaced in the copy and the module kept its values: refused too (not a meta model's, a template)."""
    entry = manifest.objects[key]
    if not isinstance(value, Mapping) or not value or has_state(value):
        return
    opt = skel.get("class") if isinstance(skel, dict) and "param_groups" in skel and "state" in skel else None
    sched = entry.get("class")
    kind, name = ("optimizer", opt) if type(opt) is str else ("scheduler", sched) if type(sched) is str else ("", None)
    if name is not None and not (kind == "optimizer" and _by_name(value)):
        raise mark(CheckpointError(
            f"entry {key!r}: the checkpoint holds the state of {a(name)} {kind}, saved from the {kind} itself; the state "
            f"holds a plain dict ({kind}.state_dict()'s copy?), and loading into a copy leaves the {kind} as it is, "
            f"silently. Put the {kind} itself in the state: {{{key!r}: {kind}}} (to read the saved values as plain "
            f"data, load into an empty dict: {{{key!r}: {{}}}})"))
    if "frozen" not in entry:
        return
    try:
        _, dest = flatten(value, key)
    except Exception:  # not tensors alone: not a state_dict() copy; the load says what does not fit
        return
    # Not for meta tensors alone: a meta model's state_dict() is the template of the load that `load_state_dict(sd,
    # assign=True)` then takes (its tensors replaced, as documented); a module left on meta fails at its first use.
    differ = [f"{p} (checkpoint {e.dtype}{e.shape}, state {'meta ' if t.is_meta else ''}{str(t.dtype)[6:]}{list(t.shape)})"
              for p, t in dest.items() if (e := manifest.tensors.get(p)) is not None
              and (list(t.shape) != e.shape or DTYPE_NAMES.get(t.dtype) != e.dtype)]
    if differ:
        raise mark(CheckpointError(
            f"entry {key!r}: the checkpoint holds a module's state; the state holds a plain dict (model.state_dict()'s "
            f"copy?) whose tensors {', '.join(differ[:5])} differ from the saved ones: a load would replace them in the "
            f"copy and leave the module as it is, silently. Put the module itself in the state: {{{key!r}: model}} "
            f"(a strict load then lists what differs; strict=False casts another dtype), or load into an empty dict, "
            f"{{{key!r}: {{}}}}, for the saved tensors as new ones"))


def _by_name(value: Mapping[str, Any]) -> bool:
    """``copy_of_object``: an optimizer state dict whose groups name their parameters (``"0.weight"``), as
    ``get_state_dict``/``get_optimizer_state_dict`` give it: the destination of DCP's documented pattern (load,
    then ``set_state_dict``), not ``optimizer.state_dict()``'s copy, whose groups hold ints."""
    groups = value.get("param_groups")
    params = [p for g in groups if isinstance(g, Mapping) for p in g.get("params") or ()] if isinstance(groups, list) else []
    return bool(params) and all(isinstance(p, str) for p in params)


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
