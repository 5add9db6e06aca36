"""Optimizers whose state no single ``state_dict()`` call on every rank can give: torch's
``ZeroRedundancyOptimizer`` keeps on each rank the state of its own part of the parameters, and
its ``state_dict()`` raises until ``consolidate_state_dict(to=r)`` gathered it on rank ``r``
alone. trainguard calls ``state_dict()`` on every rank (a save) and ``load_state_dict`` on every
rank (a load), so such an entry failed deep inside torch ("Optimizer state has not been
consolidated on this rank") on every rank. ``capture.capture`` (save) and ``loader._load`` (load)
call :func:`refuse_partitioned` for each optimizer entry first (through ``fsdp1.refuse_unsupported``), which says what to use instead.

``PostLocalSGDOptimizer`` past its averager's warm-up: each rank steps on its own gradients
between averagings, so its parameters and optimizer state differ from the other ranks', and
an entry that is not rank-local is saved once for all ranks (``planner.assign_replicated``: each
tensor from one rank): every rank resumed with one mix of them, silently. ``capture.capture``
calls :func:`refuse_diverged` on multi-rank saves, which says to mark those entries rank-local.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedValueError
from .stateful import is_rank_local


def _is(optimizer: Any, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("torch.distributed") for c in type(optimizer).__mro__)


def _inner(optimizer: Any, name: str) -> Any:
    """``optimizer`` or the optimizer it wraps (in ``.optimizer``, Accelerate's wrapper, up to 8
    deep) that is torch.distributed's class ``name``; None if none is."""
    for _ in range(8):
        if _is(optimizer, name):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def _partitioned(optimizer: Any) -> bool:
    return _inner(optimizer, "ZeroRedundancyOptimizer") is not None


def refuse_partitioned(optimizer: Any, key: str, saving: bool) -> None:
    """Raise ``UnsupportedValueError`` (an error no restart fixes) for entry ``key`` when
    ``optimizer`` is a ``ZeroRedundancyOptimizer`` (or wraps one), before anything is written or
    read; nothing otherwise."""
    if not _partitioned(optimizer):
        return
    raise UnsupportedValueError(
        f"entry {key!r}: a torch.distributed.optim.ZeroRedundancyOptimizer holds on each rank the state of its own "
        "part of the parameters, and its state_dict() works only on the one rank that consolidate_state_dict(to=...) "
        f"gathered it on; trainguard {'saves' if saving else 'loads'} every rank's state in the same call and cannot "
        f"{'save' if saving else 'load'} it. Shard the optimizer state with FSDP2 instead (fully_shard(model), then "
        "the optimizer over model.parameters(): trainguard saves each rank's shards and reshards them on load), or "
        "build the optimizer without ZeroRedundancyOptimizer (optimizer_class(model.parameters(), ...))"
    )


def refuse_diverged(optimizer: Any, key: str, state: Any, world: int) -> None:
    """``capture.capture``, for optimizer entry ``key`` of a save on ``world`` ranks: raise
    ``UnsupportedValueError`` when it is a ``PostLocalSGDOptimizer`` past its averager's warm-up
    (or wraps one, as :func:`refuse_partitioned` looks through) and it, or a module entry of
    ``state`` holding its parameters, is not rank-local."""
    local_sgd = _inner(optimizer, "PostLocalSGDOptimizer") if world > 1 else None
    if local_sgd is None:
        return
    avg = getattr(local_sgd, "averager", None)
    step, warm = getattr(avg, "step", 0), getattr(avg, "warmup_steps", 0)
    if not (type(step) is int and type(warm) is int and step > warm):
        return
    mine = {id(p) for g in local_sgd.param_groups for p in g["params"]}
    shared = [k for k, v in state.items() if isinstance(v, torch.nn.Module) and not is_rank_local(v)
              and any(id(p) in mine for p in v.parameters())]
    shared = shared if is_rank_local(optimizer) else [key, *shared]
    if shared:
        raise UnsupportedValueError(
            f"entry {key!r}: a PostLocalSGDOptimizer past its averager's warm-up (step {step}, warmup_steps {warm}): "
            "each rank steps on its own gradients between averagings, so its parameters and optimizer state differ "
            "from the other ranks', and an entry that is not rank-local is saved once for all ranks (every rank would "
            f"resume with one mix of them). Mark {shared} rank-local: set trainguard_rank_local = True on the model "
            "and on the optimizer (each rank saves its own; the run resumes at the same world size)"
        )
