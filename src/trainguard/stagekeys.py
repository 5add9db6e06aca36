"""Which tensors an async save may stage later, and where a tensor's memory is: the keys ``async_save`` asks for.

Moved out of ``stage.py`` (which re-exports every name here). Who calls what (``async_save``, every rank):

- training thread, first in the save call: :func:`protected_tensors` says which tensors only an optimizer's
  ``step()`` changes (staged later, by the save thread; keyed by :func:`tensor_key`), and
  :func:`zero_copy_ok` whether the protected chunks are written from their own memory.
- training thread, the optimizer step pre-hook while a save still copies: :func:`optimizer_writes` over the
  save's :class:`StorageKeys` (keyed by :func:`storage_key`) for an optimizer that is not in the state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .dtensor import local_part
from .tied import PLAIN
from .walks import modules


def tensor_key(t: torch.Tensor) -> tuple[int, int, torch.device] | None:
    """A tensor's memory: data pointer, size and device (None when empty). The device as torch's
    object, not its name: ``str(t.device)`` was half of the 1.4 ms ``protected_tensors`` took
    over the 632 tensors of a 1 GB MLP + Adam (``async_save``'s call)."""
    n = t.nbytes
    return (t.data_ptr(), n, t.device) if n else None


def _own_key(t: torch.Tensor) -> tuple[int, int, torch.device] | None:
    """``tensor_key`` of a parameter or optimizer state tensor, of its local shard for a DTensor;
    a plain tensor or parameter as it is (the memory is the same without ``detach()``)."""
    return tensor_key(t if type(t) in PLAIN else local_part(t.detach()))


def protected_tensors(state: Mapping[str, Any]) -> tuple[set[Any], list[torch.optim.Optimizer]]:
    """Tensors that change only in ``step()`` of an optimizer in the state (``tensor_key``s), and
    those optimizers; ``async_save.start_async_save`` copies every other tensor in the call.
    Parameters of no such optimizer are not protected: something else may update them; nor are
    the weights of embeddings with ``max_norm`` (their forward renormalizes rows in place); nor
    the tensors of an optimizer whose ``step()`` runs no pre-hook (:func:`_hooked`)."""
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    out: set[Any] = set()
    # Embeddings with max_norm renormalize the rows they look up in forward, outside step().
    renormed = {
        _own_key(m.weight)
        for v in state.values() if isinstance(v, torch.nn.Module)
        for m in modules(v) if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None
    }
    for opt in filter(_hooked, optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                # _own_key(p), spelt out for a plain tensor (two calls fewer per tensor of the save's call)
                out.add((p.data_ptr(), n, p.device) if type(p) in PLAIN and (n := p.nbytes) else _own_key(p))
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out.add((v.data_ptr(), n, v.device) if type(v) in PLAIN and (n := v.nbytes) else _own_key(v))
    out.discard(None)
    return out - renormed, optimizers


def _hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether torch runs step pre-hooks (``async_save``'s wait) before ``opt`` steps: its class's
    ``step`` is torch's wrapper (``Optimizer.__init__`` put it there), or it is a wrapper that
    skips ``Optimizer.__init__`` and steps the torch optimizer it holds as ``.optimizer``
    (Hugging Face Accelerate's ``AcceleratedOptimizer``). A custom class that skips it and does
    the math itself steps unseen: its tensors are copied in the call."""
    inner = getattr(opt, "optimizer", None)
    return any(
        isinstance(o, torch.optim.Optimizer) and getattr(type(o).step, "hooked", False) for o in (opt, inner)
    )


def storage_key(t: torch.Tensor) -> tuple[int, str] | None:
    """The memory a tensor lives in (its storage's address and device; a DTensor's local shard's),
    None when it has none. ``async_save`` keys the tensors its save thread still copies by it."""
    try:
        t = local_part(t.detach())
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, ValueError):  # a sparse tensor has no storage (torch raises a RuntimeError subclass); a lazy module's parameter, ValueError
        return None
    return (ptr, str(t.device)) if ptr else None


class StorageKeys:
    """``storage_key`` of the tensors of ``leaves`` (``.tensor``: views fixed at the save's call),
    worked out at the first ``in``: ``async_save``'s pre-step hook asks only when an optimizer not
    in the state steps while a save copies, so most saves never pay for it (2.3 ms for 1,904
    tensors here, ~8% of the call)."""

    def __init__(self, leaves: Sequence[Any]) -> None:
        self._leaves = leaves
        self._keys: set[Any] | None = None

    def __contains__(self, key: Any) -> bool:
        if self._keys is None:
            self._keys = {storage_key(lf.tensor) for lf in self._leaves} - {None}
        return key in self._keys


def optimizer_writes(optimizer: torch.optim.Optimizer, storages: StorageKeys) -> bool:
    """Whether ``step()`` of ``optimizer`` writes into one of ``storages`` (its parameters and
    state tensors); ``async_save``'s pre-step hook asks it for optimizers not in the state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if storage_key(p) in storages:
                return True
    return any(
        isinstance(v, torch.Tensor) and storage_key(v) in storages
        for s in optimizer.state.values() if isinstance(s, Mapping) for v in s.values()
    )


_ZERO_COPY_ENV = "TRAINGUARD_ASYNC_ZERO_COPY"  # "1": opt in (docs/async.md, "Zero-copy")


def zero_copy_ok(storage: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Write the protected chunks from their own memory? Opt-in (``TRAINGUARD_ASYNC_ZERO_COPY=1``),
    and only CPU tensors (a GPU's must be copied to the host anyway) onto storage that writes
    them with O_DIRECT (local files): the save then needs no staging memory and no copy, and a
    write that is not done when ``step()`` comes is finished from copies made then
    (``async_save._write_live``). Not the default: on this 2-core machine the write outlasted
    forward+backward and the stall grew (docs/async.md has the figures)."""
    from .storage.local import direct_io_enabled

    return (
        os.environ.get(_ZERO_COPY_ENV, "0") == "1"
        and getattr(storage, "direct_io", False)
        and direct_io_enabled()
        and all(not t.is_cuda for t in tensors)
    )
