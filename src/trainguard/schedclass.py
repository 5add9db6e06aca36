"""The class of a learning-rate scheduler entry, saved beside its skeleton (``"class"`` in the
manifest's entry) and checked on load, as an optimizer's is (``stateful.OptimizerAdapter``).

A scheduler's ``load_state_dict`` is ``self.__dict__.update(state_dict)``: the state of another
class loads without a word and leaves a mix of both (a ``OneCycleLR``'s ``base_lrs``, its
``max_lr / div_factor``, in a ``CosineAnnealingLR``, which then anneals from there: an lr 25 times
too small, silently; a ``CosineAnnealingLR`` of another ``T_max`` is not a mismatch, the saved one
wins as torch's does). ``capture.capture`` records :func:`scheduler_class` for each ``LRScheduler``
entry that is not rank-local (``api`` keeps it beside a shared entry's skeleton only; ``split.add_reported``
that of the group whose values the merged skeleton holds, rank 0's first) (``ReduceLROnPlateau`` included; ``SequentialLR`` and
``ChainedScheduler`` with their schedulers' classes); ``loader._load`` calls :func:`check_entries`
on every rank before anything is read (a subclass of the saved class is accepted). Checkpoints from
before the record are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim.lr_scheduler import LRScheduler


def scheduler_class(value: Any) -> str | None:
    """``"OneCycleLR"``, ``"SequentialLR[LinearLR,CosineAnnealingLR]"``; None for anything but a scheduler."""
    if not isinstance(value, LRScheduler):
        return None
    inner = getattr(value, "_schedulers", None)
    if isinstance(inner, (list, tuple)) and inner:
        return f"{type(value).__qualname__}[{','.join(scheduler_class(s) or type(s).__qualname__ for s in inner)}]"
    return type(value).__qualname__


def check_entries(manifest: Any, state: Mapping[str, Any], fresh: Mapping[str, Any] | None = None) -> None:
    """``loader._load`` (every rank, after the load was planned, before anything is read): refuse a
    scheduler entry of another class than the one saved (a ``CheckpointError`` no restart fixes),
    then :func:`names.check_frozen`. ``fresh``: the entries the checkpoint lacks, which a
    ``strict=False`` load keeps (a scheduler added since the save: ``schedconfig.warn_fresh``)."""
    from .errors import CheckpointError
    from .names import check_frozen
    from .optim_groups import a
    from .permanent import mark
    from .schedconfig import check_config, warn_fresh

    for key, value in state.items():
        saved = (manifest.objects.get(key) or {}).get("class")
        cur = scheduler_class(value)
        # A subclass of the saved class (a scheduler the run now subclasses to log or tune it) has its
        # attributes and more: loaded, as before the record (the reverse cannot be told from the name).
        bases = {c.__qualname__ for c in type(value).__mro__[1:] if issubclass(c, LRScheduler) and c is not LRScheduler}
        if type(saved) is str and cur is not None and saved != cur and saved not in bases:
            raise mark(CheckpointError(
                f"entry {key!r}: the checkpoint holds the state of {a(saved)} scheduler, the state's scheduler is "
                f"{a(cur)}; its load_state_dict() would take the saved attributes (base_lrs, last_epoch...) into a scheduler "
                f"of another kind, silently. Build {a(saved)} as at save time (to start the new scheduler instead, "
                "leave this entry out of the state and load with strict=False)"
            ))
        if cur is not None and key in manifest.objects:  # T_max, step_size... changed since the save: warned
            check_config(key, value, manifest.objects[key].get("skeleton"))
    check_frozen(manifest, state)
    if fresh:
        warn_fresh(manifest, state, fresh)
