"""Saves inside a ``torch.distributed.algorithms.join.Join`` context (DDP with uneven inputs).

A rank that runs out of batches leaves its loop and, in ``Join.__exit__``, shadows the other ranks'
collectives until every rank has joined; it never reaches a save the others make meanwhile. A save
inside the context at a step where some rank has joined therefore waits for it until the timeout and
fails (2 gloo ranks, 3 and 5 batches, a save every step: rank 1 failed after the timeout, "rank(s)
[0] did not arrive", and rank 0's Join then lost its peer). Saves made while every rank still has a
batch succeed, so the failure came only at the save steps that fell in the uneven tail.

:func:`warn_inside_join` (``capture.capture``, every rank of a multi-rank save) warns once per process
when a ``DistributedDataParallel`` entry is inside such a context; the save goes on.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

_warned = False


def warn_inside_join(state: Mapping[str, Any]) -> None:
    """``capture.capture``, every rank: warn (once per process) when a DDP entry's join is enabled."""
    global _warned
    if _warned:
        return
    for key, value in state.items():
        ddp = getattr(value, "_orig_mod", value)  # torch.compile(ddp)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and getattr(getattr(ddp, "_join_config", None), "enable", False):
            _warned = True
            warnings.warn(
                f"trainguard: save inside a Join context (entry {key!r}, DDP with uneven inputs): a rank that has run out "
                "of batches is in Join's exit, shadowing the others' collectives, and never reaches this save, which then "
                "fails on the others at its timeout. Save after the `with Join(...)` block, where every rank has joined "
                "and DDP has synced the model (docs/distributed.md). Warned once per process",
                stacklevel=4,
            )
            return
