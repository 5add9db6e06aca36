"""The size a RAM-tier save is checked against before it is written (``ramroom.goes_durable``, rank 0):
an estimate from the state, for a run's first save and for a state that grew since its last checkpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def estimated(tier: Any, state: Mapping[str, Any]) -> int:
    """``goes_durable``, rank 0, at every save: :func:`estimate` of ``state``, walked again only when the
    state's outline changed since the last walk (its entries, an optimizer's number of parameters with
    state, a dict's length, a tensor's size): a walk costs ~1 µs a tensor (1.4-1.9 ms for a model of
    632 parameters + Adam), too much for every async save's call. A module that grew in place is not
    seen until another change; a sync save into RAM that then runs out is saved again to the run
    directory, an async one fails (reported at the next save)."""
    import torch

    outline = tuple((k, id(v), len(v.state) if isinstance(v, torch.optim.Optimizer) else len(v) if isinstance(v, dict)
                     else v.nbytes if isinstance(v, torch.Tensor) else 0) for k, v in state.items())
    last = getattr(tier, "_estimate", None)
    if last is None or last[0] != outline:
        last = tier._estimate = (outline, estimate(state))
    return last[1]


def estimate(state: Mapping[str, Any]) -> int:
    """Rank 0, ``goes_durable`` (``estimated``): about what this node's ranks write, an
    upper bound rather than less. Plain tensors (replicated: the node's ranks write at most one
    copy together) count once, a DTensor's local shard once per rank of the node
    (``LOCAL_WORLD_SIZE``). Modules' parameters and buffers, optimizers' state, tensors of the
    state or of a dict in it; each tensor once. Before, a first async save into a RAM tier with
    less room failed (its error known at the next save) instead of going to the run directory."""
    import torch

    from .dtensor import is_dtensor

    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    seen: set[int] = set()
    total = 0
    for v in state.values():
        if isinstance(v, torch.nn.Module):
            ts: Any = [*v.parameters(), *v.buffers()]
        elif isinstance(v, torch.optim.Optimizer):
            ts = [t for s in v.state.values() for t in s.values()]
        else:
            ts = [v] if isinstance(v, torch.Tensor) else list(v.values()) if isinstance(v, dict) else []
        for t in ts:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.to_local().nbytes * local if is_dtensor(t) else t.nbytes
    return total
