"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): what trainguard can and cannot take.

An FSDP1 model's own ``state_dict()`` (torch's default ``FULL_STATE_DICT``) gives full tensors
by name on every rank: trainguard saves and loads those like any replicated tensors (on any
world size, into FSDP2 or a plain model). Its optimizer is another matter: with a sharded
strategy (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD``...) each rank's optimizer holds
the state of its own shard of FSDP1's flattened parameters (``use_orig_params=False``: one 1-D
``FlatParameter`` per wrapped module; ``True``: 1-D pieces of them, a different size on each
rank). trainguard keys optimizer state by parameter name and saves a plain tensor of the same
name from one rank, so ``use_orig_params=False`` saved one rank's shards for every rank (a
warning, then a resume that was not the run saved) and ``True`` was refused as ranks whose
state differs, with the advice to pass ``split_state=True``, which does not apply.

``capture.capture`` (save) and ``loader._load`` (load) call :func:`refuse_unsupported` for each entry,
on every rank, before anything is written or read: a sharded FSDP1 optimizer, and an FSDP1
model under a ``state_dict_type`` other than a full one on every rank (``SHARDED_STATE_DICT``:
ShardedTensors; ``LOCAL_STATE_DICT``: flat shards; ``rank0_only=True``: nothing on the other
ranks) are refused with what to change. Nothing here imports torch.distributed.fsdp: a state
holds FSDP1 only when the user imported it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .errors import UnsupportedValueError
from .zero import refuse_partitioned

_FSDP_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"
_FLAT_MODULE = "torch.distributed.fsdp._flat_param"

USE_FSDP2 = (
    "Use FSDP2 instead: torch.distributed.fsdp.fully_shard(layer) on each layer and fully_shard(model), in place "
    "of FullyShardedDataParallel(model, ...), then the optimizer over model.parameters(): trainguard saves each "
    "rank's DTensor shards by name and reshards them on load (an FSDP1 model saved alone loads into it)"
)


def _fsdp_class() -> Any:
    mod = sys.modules.get(_FSDP_MODULE)
    return getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None


def _sharded(flat: Any) -> bool:
    """True when FSDP1 flat parameter ``flat`` holds only this rank's part of its parameters."""
    full, mine = getattr(flat, "_unpadded_unsharded_size", None), getattr(flat, "_sharded_size", None)
    return full is not None and mine is not None and tuple(full) != tuple(mine)


def _handles(state: Any) -> list[tuple[Any, Any]]:
    """``(FSDP1 module, its flat parameter)`` for every FSDP1 module of the state's module entries."""
    fsdp = _fsdp_class()
    if fsdp is None:
        return []
    out = []
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for sub in value.modules():
                handle = getattr(sub, "_handle", None) if isinstance(sub, fsdp) else None
                if handle is not None and getattr(handle, "flat_param", None) is not None:
                    out.append((sub, handle.flat_param))
    return out


def _strategy(module: Any) -> str:
    s = getattr(module, "sharding_strategy", None)
    return getattr(s, "name", None) or str(s)


def refuse_unsupported(value: Any, key: str, state: Any, saving: bool) -> None:
    """``capture.capture`` and ``loader._load``, every rank, for entry ``key`` of ``state``, before
    anything is written or read: ``zero.refuse_partitioned`` for an optimizer, then :func:`refuse_fsdp1`."""
    if isinstance(value, torch.optim.Optimizer):
        refuse_partitioned(value, key, saving)  # ZeroRedundancyOptimizer: its state_dict() raises on most ranks
    refuse_fsdp1(value, key, state, saving)


def refuse_fsdp1(value: Any, key: str, state: Any, saving: bool) -> None:
    """For entry ``key`` of ``state`` (:func:`refuse_unsupported`): raise
    ``UnsupportedValueError`` when ``value`` is an optimizer over parameters of a sharded FSDP1
    model, or a module holding an FSDP1 module whose ``state_dict()`` would not give full tensors
    on every rank. Nothing otherwise (and nothing is imported) when FSDP1 was never imported."""
    if _FSDP_MODULE not in sys.modules:
        return
    verb = "save" if saving else "load"
    if isinstance(value, torch.optim.Optimizer):
        _refuse_optimizer(value, key, state, verb)
    elif isinstance(value, torch.nn.Module):
        _refuse_module(value, key, verb)


def _refuse_optimizer(optimizer: torch.optim.Optimizer, key: str, state: Any, verb: str) -> None:
    flat_cls = getattr(sys.modules.get(_FLAT_MODULE), "FlatParameter", ())
    sharded: dict[int, Any] = {}  # id(param) -> its FSDP1 module, for sharded flat parameters
    for sub, flat in _handles(state):
        if _sharded(flat):
            for p in [flat, *(getattr(flat, "_params", None) or ()), *(getattr(flat, "_shared_params", None) or ())]:
                sharded[id(p)] = sub
    for group in optimizer.param_groups:
        for p in group["params"]:
            flat_param = bool(flat_cls) and isinstance(p, flat_cls)
            if id(p) in sharded or (flat_param and _sharded(p)):
                how = "False (one 1-D FlatParameter per wrapped module)" if flat_param else "True (1-D pieces of them)"
                strategy = _strategy(sharded[id(p)]) if id(p) in sharded else "a sharded one"
                raise UnsupportedValueError(
                    f"entry {key!r}: the optimizer holds parameters of a FullyShardedDataParallel (FSDP1) model with "
                    f"sharding strategy {strategy} and use_orig_params={how}: each rank's optimizer state covers only "
                    "its own shard of FSDP1's flattened parameters, not whole tensors by name, and trainguard cannot "
                    f"{verb} it (one rank's shard would be kept for all ranks). {USE_FSDP2}. Or use "
                    "ShardingStrategy.NO_SHARD (or DDP), whose optimizer state is whole on every rank"
                )


def _refuse_module(module: torch.nn.Module, key: str, verb: str) -> None:
    for sub, _ in _handles({key: module}):
        kind = getattr(getattr(sub, "_state_dict_type", None), "name", "FULL_STATE_DICT")
        rank0 = bool(getattr(getattr(sub, "_state_dict_config", None), "rank0_only", False))
        if kind != "FULL_STATE_DICT" or rank0:
            what = f"{kind} with rank0_only=True" if kind == "FULL_STATE_DICT" else kind
            raise UnsupportedValueError(
                f"entry {key!r}: a FullyShardedDataParallel (FSDP1) module is set to state_dict_type {what}, whose "
                "state_dict() does not give every rank the full tensors by name (SHARDED_STATE_DICT: ShardedTensors; "
                "LOCAL_STATE_DICT: this rank's flat shard; rank0_only: nothing on the other ranks); trainguard cannot "
                f"{verb} it. Call tg.{verb} outside FSDP.state_dict_type(...) and without FSDP.set_state_dict_type "
                "(torch's default FULL_STATE_DICT, rank0_only=False, is what trainguard takes; offload_to_cpu=True is "
                f"fine), or {USE_FSDP2[0].lower()}{USE_FSDP2[1:]}"
            )
