"""Optimizers whose state no single ``state_dict()`` call on every rank can give: torch's
``ZeroRedundancyOptimizer`` keeps on each rank the state of its own part of the parameters, and
its ``state_dict()`` raises until ``consolidate_state_dict(to=r)`` gathered it on rank ``r``
alone. trainguard calls ``state_dict()`` on every rank (a save) and ``load_state_dict`` on every
rank (a load), so such an entry failed deep inside torch ("Optimizer state has not been
consolidated on this rank") on every rank. ``capture.capture`` (save) and ``loader._load`` (load)
call :func:`refuse_partitioned` for each optimizer entry first, which says what to use instead.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedValueError


def _partitioned(optimizer: Any) -> bool:
    for _ in range(8):  # a wrapper that keeps the real optimizer in .optimizer (Accelerate's)
        if any(c.__name__ == "ZeroRedundancyOptimizer" and c.__module__.startswith("torch.distributed")
               for c in type(optimizer).__mro__):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return False
    return False


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
