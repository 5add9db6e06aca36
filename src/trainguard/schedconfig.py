"""A learning-rate scheduler whose configuration changed between runs (``T_max``, ``step_size``,
``total_steps``... or ``base_lrs`` through the optimizer's lr): warned about on load.

A scheduler's ``load_state_dict`` is ``self.__dict__.update(state_dict)``: every saved attribute
wins, its configuration included. A run resumed with ``CosineAnnealingLR(T_max=40)`` after a save
with ``T_max=10`` (training extended) anneals to ``eta_min`` at step 10 and climbs back to the
full lr by step 20, silently (seen). :func:`check_config` (called by ``schedclass.check_entries``:
``loader._load``, every rank, before anything is read) compares the state's scheduler, as built
for this run, with the saved attributes, and warns naming each one that differs and how to apply
the new value. Compared: top-level attributes that are plain values or lists of them, but the
progress a resume restores (``last_epoch``, ``ReduceLROnPlateau``'s ``best``...) and private ones;
and those of the schedulers a ``SequentialLR`` or ``ChainedScheduler`` chains, with the milestones.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import CheckpointError
from .flatten import unflatten
from .optim_hparams import same
from .userframe import user_stacklevel

_PROGRESS = frozenset({"last_epoch", "best", "num_bad_epochs", "cooldown_counter", "mode_worse", "verbose", "T_cur", "T_i"})


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(isinstance(x, (bool, int, float, str)) or x is None for x in v)
    return isinstance(v, (bool, int, float, str)) or v is None


def check_config(key: str, scheduler: Any, saved: Any) -> None:
    """Warn when ``saved`` (the scheduler entry's skeleton in the checkpoint) holds configuration
    values other than ``scheduler``'s own (the one this run built). Never raises: a scheduler
    whose ``state_dict()`` fails here is left to the load."""
    if not isinstance(saved, dict):
        return
    try:
        cur = scheduler.state_dict()
    except Exception:  # noqa: BLE001 - the load reports it
        return
    differ = _differ(saved, cur, "")
    if not differ:
        return
    was = ", ".join(f"{k}={s!r}" for k, s, _ in differ)
    now = ", ".join(f"{k}={c!r}" for k, _, c in differ)
    hint = "; base_lrs: set each param group's lr too" if any(k.endswith("base_lrs") for k, *_ in differ) else ""
    k, _, c = next((d for d in differ if not d[0].startswith("len(")), (None, None, None))
    how = f"set them after the restore (e.g. sched.{k} = {c!r}{hint})" if k else "build it with as many schedulers"
    warnings.warn(
        f"entry {key!r}: the checkpoint's scheduler has {was}, this run built it with {now}; the restore "
        "takes the checkpoint's (a scheduler's load_state_dict takes every saved attribute, as torch's does). "
        f"To use this run's, {how}; "
        "ignore this if the change is not meant for this run (docs/checkpoints.md)",
        stacklevel=user_stacklevel(),  # the caller of tg.load or restore (a fixed 6 named userload.py)
    )


def _differ(saved: dict[str, Any], cur: dict[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    """``(attribute, saved, this run's)`` for each configuration value that differs. A
    ``SequentialLR``'s milestones and the configuration of the schedulers it (or a
    ``ChainedScheduler``) chains are compared too: ``_schedulers[1].T_max`` (before, a longer
    cosine phase after the warmup went unnoticed: the chained states are lists of dicts)."""
    out = [
        (prefix + k, _decoded(saved[k]), cur[k]) for k in sorted(saved)
        if (not k.startswith("_") or k == "_milestones") and k not in _PROGRESS and k in cur
        and _plain(_decoded(saved[k])) and _plain(cur[k]) and not same(_decoded(saved[k]), cur[k])
    ]
    subs, mine = saved.get("_schedulers"), cur.get("_schedulers")
    if isinstance(subs, list) and isinstance(mine, list):
        if len(subs) != len(mine):
            return [*out, (f"{prefix}len(_schedulers)", len(subs), len(mine))]
        for i, (a, b) in enumerate(zip(subs, mine)):
            if isinstance(a, dict) and isinstance(b, dict):
                out += _differ(a, b, f"{prefix}_schedulers[{i}].")
    return out


def _decoded(v: Any) -> Any:
    """A saved configuration value as the script holds it: the skeleton writes a non-finite float as
    ``{"$float": "nan"}`` and a tuple as ``{"$tuple": [...]}``, which were skipped as not plain, so a
    ``gamma`` changed from NaN to 0.5 (or a tuple of milestones) was never compared. ``same``
    (optim_hparams) then takes NaN as equal to NaN and a tuple as equal to a list of the same items."""
    if isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("$float", "$tuple"):
        try:
            return unflatten(v, _no_tensor, where="scheduler configuration")
        except (CheckpointError, TypeError, ValueError):  # a damaged value: left to the load, not compared
            return v
    return [_decoded(x) for x in v] if isinstance(v, list) else v


def _no_tensor(path: str) -> Any:
    raise CheckpointError(f"a tensor reference ({path[:60]!r}) in a configuration value")


def warn_fresh(manifest: Any, loaded: Any, fresh: Any) -> None:
    """``schedclass.check_entries`` (``loader._load``, every rank, before anything is read; a load with
    ``strict=False``, which keeps the entries ``fresh`` that the checkpoint lacks): warn when such an
    entry is a scheduler added since the save whose optimizer, an entry of ``loaded``, takes the
    checkpoint's learning rates in place of those the scheduler set when it was built. Torch's
    schedulers scale the optimizer's current lr at each ``step()`` (a ``LinearLR`` warmup built with
    ``start_factor=0.5`` over a saved lr of 0.1 climbed to 0.2, twice its peak, silently)."""
    for key, sched in fresh.items():
        opt = getattr(sched, "optimizer", None)
        if not isinstance(getattr(sched, "base_lrs", None), list) or opt is None:
            continue
        okey = next((k for k, v in loaded.items() if v is opt or getattr(v, "optimizer", None) is opt), None)
        skel = (manifest.objects.get(okey) or {}).get("skeleton") if okey is not None else None
        groups = skel.get("param_groups") if isinstance(skel, dict) else None
        if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
            continue
        saved = [g.get("lr") if isinstance(g, dict) else None for g in groups]
        now = [g.get("lr") for g in opt.param_groups]
        if all(isinstance(x, (int, float)) for x in [*saved, *now]) and any(
                abs(a - b) > 1e-12 * max(abs(a), abs(b)) for a, b in zip(saved, now)):
            warnings.warn(
                f"strict=False: scheduler entry {key!r} is not in the checkpoint and starts fresh, but optimizer "
                f"{okey!r} takes the checkpoint's learning rates {saved[:4]} in place of the {now[:4]} this scheduler "
                "set when it was built; its step() scales the optimizer's current lr, so its schedule now starts "
                f"from the checkpoint's. To run it as built, set the lrs after the load: for g, lr in "
                f"zip({okey}.param_groups, {key}.get_last_lr()): g['lr'] = lr", stacklevel=user_stacklevel())
