"""The state of DDP communication hooks, which a resume needs to continue the run it saved.

``DistributedDataParallel.register_comm_hook(state, hook)`` keeps ``state`` outside the module: a
resumed process builds a fresh one. For torch's ``powerSGD_hook`` that fresh ``PowerSGDState``
starts at ``iter`` 0 (plain all-reduce again for ``start_powerSGD_iter`` steps), with no error
feedback, no warm-start ``P``/``Q`` and its seed generator at the start: every parameter of a
resumed run differed from the run that went on (2 gloo ranks, 4 steps after the resume). For
``post_localSGD_hook`` a fresh ``PostLocalSGDState`` all-reduces over the whole group again for
``start_localSGD_iter`` steps.

``state["powersgd"] = powersgd_state`` (torch documents pickling it for checkpoints; trainguard does
not unpickle) is saved through :class:`HookStateAdapter` (``stateful.adapt``): its step counter, the
NumPy generator that seeds ``Q``, and the error feedback and ``P``/``Q`` tensors per bucket. A
``PowerSGDState`` is rank-local (``stateful.is_rank_local``): each rank's error feedback is its own.
Its settings (``start_powerSGD_iter``...) stay those the resumed process built it with.

:func:`warn_unsaved` (``capture.capture``, every rank, each multi-rank save) warns, on rank 0 once per
process, when a DDP of the state has such a hook whose state is not an entry of the state.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

POWER_SGD, LOCAL_SGD = "PowerSGDState", "PostLocalSGDState"
_warned = False


def hook_kind(value: Any) -> str | None:
    """``POWER_SGD`` / ``LOCAL_SGD`` for torch's hook states (subclasses too), else None."""
    for c in type(value).__mro__:
        if c.__name__ in (POWER_SGD, LOCAL_SGD) and c.__module__.startswith("torch.distributed"):
            return c.__name__
    return None


class HookStateAdapter:
    """What ``stateful.adapt`` gives for a ``PowerSGDState`` or ``PostLocalSGDState`` entry: the
    state a hook changes as it runs, as tensors and JSON values; called on every rank that holds it."""

    def __init__(self, hook_state: Any) -> None:
        self.hs = hook_state
        self.kind = hook_kind(hook_state)

    def state_dict(self) -> dict[str, Any]:
        hs = self.hs
        if self.kind == LOCAL_SGD:
            return {"kind": LOCAL_SGD, "iter": int(hs.iter)}
        algo, keys, pos, has_gauss, cached = hs.rng.get_state()
        out: dict[str, Any] = {
            "kind": POWER_SGD, "iter": int(hs.iter), "matrix_approximation_rank": int(hs.matrix_approximation_rank),
            "rng": {"algo": str(algo), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "stats": [int(hs.total_numel_before_compression), int(hs.total_numel_after_compression), int(hs.next_stats_report)],
        }
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            out[name] = {str(k): v for k, v in getattr(hs, name).items()}  # bucket index -> tensor
        devices = {str(v.device) for name in ("error_dict", "p_memory_dict", "q_memory_dict") for v in getattr(hs, name).values()}
        out["device"] = devices.pop() if len(devices) == 1 else "cpu"
        return out

    def check_saved_state(self, sd: Mapping[str, Any]) -> None:
        """``load_state_dict``, and ``loader._load`` before anything is read (``prechecks.py``, with
        None for the tensors): refuse another hook's state, or P and Q of another rank."""
        from .errors import CheckpointError
        from .permanent import mark

        if sd.get("kind") != self.kind:
            raise mark(CheckpointError(f"the checkpoint holds a {sd.get('kind')}'s state, the state's entry is a {self.kind}"))
        if self.kind == LOCAL_SGD:
            return
        rank = int(sd["matrix_approximation_rank"])
        if sd["p_memory_dict"] and rank != self.hs.matrix_approximation_rank:
            raise mark(CheckpointError(
                f"the PowerSGDState was saved with matrix_approximation_rank={rank} (its warm-start P and Q have that "
                f"many columns), this one has {self.hs.matrix_approximation_rank}; build it with matrix_approximation_rank={rank}"
            ))

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """``loader._load``, every rank holding the entry, after the bytes were read and verified."""
        self.check_saved_state(sd)
        hs = self.hs
        hs.iter = int(sd["iter"])
        if self.kind == LOCAL_SGD:
            return
        r = sd["rng"]
        hs.rng.set_state((r["algo"], np.asarray(r["keys"].numpy(), dtype=np.uint32), int(r["pos"]), int(r["has_gauss"]),
                          float(r["cached_gaussian"])))
        hs.total_numel_before_compression, hs.total_numel_after_compression, hs.next_stats_report = (int(x) for x in sd["stats"])
        dev = torch.device(sd.get("device", "cpu"))
        if dev.type == "cuda":  # saved from CUDA buckets: the hook adds them to this process's bucket buffers
            dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            setattr(hs, name, {int(k): v.to(dev) for k, v in sd[name].items()})


def warn_unsaved(state: Mapping[str, Any], rank: int) -> None:
    """``capture.capture``, every rank of a multi-rank save: warn (rank 0, once per process) when a
    ``DistributedDataParallel`` entry has a PowerSGD or post-local-SGD hook registered whose state
    object is not an entry of ``state``; the save goes on."""
    global _warned
    if _warned or rank != 0:
        return
    ids = {id(v) for v in state.values()}
    for key, value in state.items():
        ddp = getattr(value, "_orig_mod", value)  # torch.compile(ddp)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            continue
        for hook, hs in getattr(ddp, "_comm_hooks", ()):
            if hook_kind(hs) and id(hs) not in ids:
                _warned = True
                warnings.warn(
                    f"trainguard: entry {key!r} has DDP communication hook {getattr(hook, '__name__', hook)!r} whose "
                    f"{hook_kind(hs)} (step counter{', error feedback, P/Q' if hook_kind(hs) == POWER_SGD else ''}) is "
                    "not in the saved state: a resumed run starts it afresh and does not continue this one. Add it to "
                    f"the state, e.g. state[\"comm_hook\"] = <the {hook_kind(hs)} given to register_comm_hook>. Warned "
                    "once per process (docs/distributed.md)",
                    stacklevel=4,
                )
                return
