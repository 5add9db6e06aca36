"""The script's optimizer hyperparameters that a restore replaces (``stateful.OptimizerAdapter``).

torch's ``Optimizer.load_state_dict`` takes every hyperparameter of each parameter group from the
checkpoint: a run resumed after ``weight_decay=0.1`` became ``0.05`` in the script (or the
scheduler's peak ``lr=3e-4`` became ``1e-4``) trains on with the old values, and nothing says so. That is
torch's rule and trainguard keeps it (a resumed run continues the saved one); it warns, once per
load, naming each group, key, and both values, and says how to apply the script's value.

Compared, so that an ordinary resume warns about nothing:

* the learning rate as a torch LR scheduler records it (``initial_lr``, set when the scheduler is
  built, in both the script's groups and the checkpoint's); ``lr`` itself is not compared: a
  scheduler, or a loop that sets ``group["lr"]`` every step (nanoGPT), changes it during training;
* the keys that change the update and that no torch scheduler moves: ``weight_decay``, ``eps``,
  ``betas`` and ``momentum`` (not when the group is cycled: OneCycleLR/CyclicLR keep
  ``base_momentum``), ``dampening``, ``nesterov``, ``amsgrad``, ``maximize``, ``alpha``,
  ``centered``, ``rho``, ``lr_decay``, ``decoupled_weight_decay``;
* not the performance switches (``foreach``, ``fused``, ``capturable``, ``differentiable``), which
  do not change the math, nor keys present on one side only (a scheduler added since the save).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .userframe import user_stacklevel

MATH = ("initial_lr", "weight_decay", "eps", "betas", "momentum", "dampening", "nesterov", "amsgrad", "maximize",
        "alpha", "centered", "rho", "lr_decay", "decoupled_weight_decay")
CYCLED = ("betas", "momentum")  # moved by OneCycleLR/CyclicLR (cycle_momentum), which set base_momentum


class OptimizerSettingsWarning(UserWarning):
    """A restore replaced hyperparameters the script set differently (``optim_hparams.py``)."""


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a tensor lr (capturable, fused)
        return v.item()
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def same(a: Any, b: Any) -> bool:
    """``a == b`` for a hyperparameter (a plain value, or a tuple/list of them), but NaN equals NaN: a
    value the script set to ``float("nan")`` and the checkpoint holds as NaN is not a change (before,
    ``!=`` warned about it on every load)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def overridden(current: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line (group, key, the script's value, the checkpoint's) for each compared key that differs."""
    out = []
    for gi, (cur, old) in enumerate(zip(current, saved)):
        cycled = "base_momentum" in cur or "base_momentum" in old
        for key in MATH:
            if key not in cur or key not in old or (cycled and key in CYCLED):
                continue
            a, b = _plain(cur[key]), _plain(old[key])
            if not same(a, b):
                out.append(f"group {gi} {key}: the script set {a!r}, the checkpoint has {b!r}")
    return out


def warn_overridden(current: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]]) -> None:
    """``OptimizerAdapter.load_state_dict`` (every rank, right before torch's ``load_state_dict``
    replaces the groups' values): warn when the checkpoint's hyperparameters differ from the
    script's. Same on every rank (the same script and checkpoint): no round needed."""
    lines = overridden(current, saved)
    if not lines:
        return
    more = f" (and {len(lines) - 8} more)" if len(lines) > 8 else ""
    warnings.warn(
        f"the optimizer's hyperparameters come from the checkpoint, as torch's load_state_dict does; they "
        f"differ from the ones this script built it with: {'; '.join(lines[:8])}{more}. Training continues with the "
        "checkpoint's values. To use the script's, set them after restore, e.g. `for g in optimizer.param_groups: "
        "g['weight_decay'] = 0.05`; for the learning rate with a scheduler, set both g['lr'] and g['initial_lr'] and "
        "the scheduler's base_lrs",
        OptimizerSettingsWarning, stacklevel=user_stacklevel(),
    )
