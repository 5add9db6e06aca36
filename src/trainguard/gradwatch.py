"""Warn about a save that leaves gradients behind: one in the middle of a gradient-accumulation
window, or between ``backward()`` and ``optimizer.step()``.

Gradients (``.grad``) are not saved (docs/checkpoints.md). A resume from such a save starts the
window again without the gradients of its earlier micro-batches, so it does not continue
bit-identically. The manager (``CheckpointManager.restore`` and ``save``, every rank, on its own
state) calls :func:`watch` on the optimizers of the state: from then on a hook on each of their
parameters notes a gradient arriving (``register_post_accumulate_grad_hook``), torch's global step
post-hook clears the note at that optimizer's ``step()`` (or at the ``step()`` of an optimizer it
wraps, accelerate's AcceleratedOptimizer, which torch's hooks never see). :func:`check` (``save``, before the save
starts, every rank) warns when an optimizer's parameters still hold finite, non-zero gradients
that arrived after its last ``step()``: those a resume would not have. A step the GradScaler
skipped (inf/NaN gradients) is not warned about: the loop zeroes them anyway.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class PendingGradientsWarning(UserWarning):
    """A checkpoint was saved while the optimizer's parameters held gradients not yet used by a
    ``step()``; gradients are not saved, so a resume from it loses them."""


class _Tracker:
    __slots__ = ("arrived", "__weakref__")

    def __init__(self) -> None:
        self.arrived: set[int] = set()  # id() of the parameters whose gradient arrived since the last step()


_TRACKERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Tracker] = weakref.WeakKeyDictionary()
_BY_PARAM: dict[int, list[weakref.ref[_Tracker]]] = {}  # id(param) -> trackers of the optimizers holding it
_POST_HOOK: Any = None


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    t = _TRACKERS.get(optimizer)
    if t is not None:
        t.arrived.clear()
    elif any(t.arrived for t in _TRACKERS.values()):  # an optimizer the state holds wrapped (accelerate's)
        for group in optimizer.param_groups:
            for p in group["params"]:
                for ref in _BY_PARAM.get(id(p), ()):
                    if (w := ref()) is not None:
                        w.arrived.discard(id(p))


def _arrived(param: torch.Tensor) -> None:
    for ref in _BY_PARAM.get(id(param), ()):
        t = ref()
        if t is not None:
            t.arrived.add(id(param))


def _forget(key: int) -> None:
    _BY_PARAM.pop(key, None)  # the parameter is gone (its id may be reused)


def _optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    return [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]


def watch(state: Mapping[str, Any]) -> None:
    """Start noting gradient arrivals for the optimizers among ``state``'s values (once each).
    Called by the manager's ``restore`` and ``save`` on every rank."""
    global _POST_HOOK
    for opt in _optimizers(state):
        if opt in _TRACKERS:
            continue
        if _POST_HOOK is None:
            _POST_HOOK = register_optimizer_step_post_hook(_after_step)
        t = _TRACKERS[opt] = _Tracker()
        ref = weakref.ref(t)
        for group in opt.param_groups:
            for p in group["params"]:
                if not isinstance(p, torch.Tensor) or not p.requires_grad:
                    continue
                refs = _BY_PARAM.get(id(p))
                if refs is None:  # one hook per parameter, however many optimizers (managers) see it
                    refs = _BY_PARAM[id(p)] = []
                    p.register_post_accumulate_grad_hook(_arrived)
                    weakref.finalize(p, _forget, id(p))
                refs[:] = [r for r in refs if r() is not None] + [ref]


def pending(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names (``group[i]/param[j]``) of ``optimizer``'s parameters holding finite, non-zero
    gradients that arrived after its last ``step()``; [] when none or when any is not finite."""
    t = _TRACKERS.get(optimizer)
    if t is None or not t.arrived:
        return []
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            g = getattr(p, "grad", None)
            if id(p) not in t.arrived or g is None:
                continue
            with torch.no_grad():
                local = g.to_local() if hasattr(g, "to_local") else g
                if not bool(torch.isfinite(local).all()):
                    return []  # a step a GradScaler skipped: the loop zeroes them
                if bool(local.any()):
                    out.append(f"group[{gi}]/param[{pi}]")
    return out


def check(state: Mapping[str, Any], step: int) -> None:
    """Warn (PendingGradientsWarning) when an optimizer of ``state`` holds gradients a resume
    from this save would not have. Called by ``CheckpointManager.save`` before a save, every rank."""
    for key, opt in state.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        names = pending(opt)
        if names:
            warnings.warn(
                f"trainguard: the save of step {step} comes after backward() but before {key!r}.step(): "
                f"{len(names)} parameter(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) hold "
                "gradients no step() used yet. Gradients are not saved, so a resume from this checkpoint loses "
                "them (the rest of a gradient-accumulation window would start without its earlier micro-batches) "
                "and does not continue bit-identically. Call mgr.save(step, state) after optimizer.step(), at "
                "the end of an accumulation window (docs/checkpoints.md#what-is-saved)",
                PendingGradientsWarning, stacklevel=5,
            )


def at_save(state: Mapping[str, Any], step: int, *, saving: bool) -> None:
    """``CheckpointManager.save`` on every rank, at every call: watch ``state``'s optimizers (a
    first call without ``restore``), and when ``saving``, :func:`check` them."""
    watch(state)
    if saving:
        check(state, step)


def saved_already(mgr: Any, step: int) -> bool:
    """``CheckpointManager.save`` on every rank: whether ``step`` is saved (or being saved in the
    background) already, so this call saves nothing and leaves no gradients behind to warn of: a loop
    that calls ``mgr.save(completed_steps, state)`` on every micro-batch, ``completed_steps`` counting
    optimizer steps, saves at the step and skips the calls of the window that follows."""
    if step in getattr(mgr, "_rejected", ()):
        return False  # restore() found that checkpoint unusable: saved again
    pending = getattr(mgr, "_pending", None) is not None and getattr(mgr, "_pending_step", None) == step
    return pending or getattr(mgr, "last_saved_step", None) == step
