"""``CheckpointManager.save(metrics=...)``: the values as stored, or refused before a byte is written.

Called by ``manager.CheckpointManager.save`` (through ``policies.checked_metrics``, re-exported
there) before the save's first round, so that a refusal on some ranks fails the save on every
rank at once (``start_save(preflight=...)``) instead of leaving the others waiting.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import UnsupportedValueError

# A value ``CheckpointManager.save(metrics=...)`` takes (its hint): a number, or a tensor, numpy array or
# numpy scalar of one value (``metrics={"loss": loss}``). The hint said float: a type-checked script got an
# error for that documented call.
MetricValue = float | torch.Tensor | np.ndarray | np.generic


def checked_metrics(metrics: Mapping[str, Any] | None) -> tuple[dict[str, float], UnsupportedValueError | None]:
    """:func:`metric_values`, its refusal returned, not raised: ``CheckpointManager.save`` hands
    it to the save's first round (``start_save(preflight=...)``), so that a value refused on
    some ranks only fails the save on every rank at once instead of leaving the others waiting."""
    try:
        return metric_values(metrics), None
    except UnsupportedValueError as e:
        return {}, e


def metric_values(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``save(metrics=...)`` as stored: one-element tensors and numpy scalars become numbers
    (``metrics={"loss": loss}`` is common); anything else that is not a number is refused here,
    before a byte is written. nan and ±inf are kept (``KeepBest`` ranks them last)."""
    if metrics is not None and not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics={metrics!r}: pass a dict of names to numbers, e.g. metrics={{'loss': 0.25}}")
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if hasattr(v, "item") and (v.numel() if hasattr(v, "numel") else getattr(v, "size", 1)) == 1 and not getattr(v, "is_meta", False):
            try:  # a tensor, numpy array or scalar of one value (a meta tensor has none: refused below)
                v = v.item()
            except Exception as e:  # no Python number for it (a float4_e2m1fn_x2 or nested tensor): refused, named
                raise UnsupportedValueError(
                    f"metrics[{k!r}]: a {type(v).__name__} whose .item() fails ({type(e).__name__}: {str(e)[:120]}); "
                    "pass a Python number (float or int)"
                ) from e
        if type(k) is not str or not isinstance(v, numbers.Real):
            raise UnsupportedValueError(
                f"metrics[{k!r}] = {v!r} ({type(v).__name__}): metrics map str names to numbers "
                "(a one-element tensor is converted with .item())"
            )
        out[k] = v if type(v) in (int, float, bool) else float(v)  # np.longdouble (its .item() is itself), a Fraction
    return out
