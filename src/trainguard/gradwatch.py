"""Warn about a save that leaves gradients behind: one in the middle of a gradient-accumulation
window, or between ``backward()`` and ``optimizer.step()``.

Gradients (``.grad``) are not saved (docs/checkpoints.md). A resume from such a save starts the
window again without the gradients of its earlier micro-batches, so it does not continue
bit-identically. The manager (``CheckpointManager.restore`` and ``save``, every rank, on its own
state) calls :func:`watch` on the optimizers of the state: from then on torch's global step
post-hook records, at each ``step()`` of such an optimizer (or of an optimizer it wraps,
accelerate's AcceleratedOptimizer, which torch's hooks never see), each parameter's gradient as it
is then: the tensor (a weak reference) and its version counter, which every write into it bumps.
:func:`check` (``save``, before the save starts, every rank) warns when an optimizer's parameters
hold non-zero gradients that are another tensor or were written since its last ``step()``:
those a resume would not have. A step the GradScaler skipped (inf/NaN gradients) counts as a
step (``GradScaler.step`` is wrapped to see it): the loop zeroes them anyway. Nothing runs in ``backward()``: a Python hook per parameter,
as before, cost 2-4 microseconds per parameter at every ``backward()`` (see ``_after_step``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .userframe import warn_each


class PendingGradientsWarning(UserWarning):
    """A checkpoint was saved while the optimizer's parameters held gradients not yet used by a
    ``step()``; gradients are not saved, so a resume from it loses them."""


class _Tracker:
    __slots__ = ("seen", "scaled", "__weakref__")

    def __init__(self) -> None:
        self.seen: dict[int, Any] = {}  # id(param) -> _stamp of its gradient at the last step() (or at watch())
        self.scaled = False  # stepped through a GradScaler: its skipped steps are seen (_scaler_step)


_TRACKERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Tracker] = weakref.WeakKeyDictionary()
_BY_PARAM: dict[int, list[weakref.ref[_Tracker]]] = {}  # id(param) -> trackers of the optimizers holding it
_POST_HOOK: Any = None


def _version(g: torch.Tensor) -> Any:
    if type(g) is torch.Tensor:
        return g._version
    local = getattr(g, "_local_tensor", None)  # a DTensor's (FSDP2) gradient: written into its local shard too
    return g._version if local is None else (g._version, local._version)


def _stamp(p: torch.Tensor) -> Any:
    g = p.grad
    return None if g is None else (weakref.ref(g), _version(g))


def _written(p: torch.Tensor, stamp: Any) -> bool:
    """Whether ``p``'s gradient is another tensor than, or was written since, ``stamp``."""
    g = p.grad
    return g is not None and (stamp is None or stamp[0]() is not g or stamp[1] != _version(g))


def _params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, torch.Tensor) and p.requires_grad:
                yield p


def _snapshot(optimizer: torch.optim.Optimizer) -> dict[int, Any]:
    """``_stamp`` of each parameter of ``optimizer``, inlined: this runs at every ``step()``."""
    seen, ref, plain = {}, weakref.ref, torch.Tensor
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            seen[id(p)] = None if g is None else (ref(g), g._version if type(g) is plain else _version(g))
    return seen


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Torch's global step post-hook (any optimizer's ``step()``): record the gradients it used.
    Once per step instead of once per parameter per ``backward()`` (bench/gradwatch_cost.py)."""
    t = _TRACKERS.get(optimizer)
    if t is not None:
        t.seen = _snapshot(optimizer)
    elif _BY_PARAM:  # an optimizer the state holds wrapped (accelerate's): its parameters' trackers
        for p in _params(optimizer):
            for ref in _BY_PARAM.get(id(p), ()):
                if (w := ref()) is not None:
                    w.seen[id(p)] = _stamp(p)


def _scaler_step(orig: Any) -> Any:
    """``torch.amp.GradScaler.step`` wrapped (once, by :func:`watch`): a step the scaler skips
    (inf/NaN gradients) never calls the optimizer's ``step()`` nor its hooks, yet it used the
    window's gradients as a step does (the loop zeroes them): they are recorded as used."""
    @functools.wraps(orig)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, optimizer, *args, **kwargs)
        try:
            t = _TRACKERS.get(optimizer)
        except TypeError:  # an optimizer wrapper that cannot be weakly referenced: never watched
            t = None
        if t is not None:
            t.seen, t.scaled = _snapshot(optimizer), True
        return out

    step._trainguard = True  # type: ignore[attr-defined]
    return step


def _forget(key: int) -> None:
    _BY_PARAM.pop(key, None)  # the parameter is gone (its id may be reused)


def _optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    return [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]


def watch(state: Mapping[str, Any]) -> None:
    """Start watching the optimizers among ``state``'s values (once each): their gradients as they
    are now count as used. Called by the manager's ``restore`` and ``save`` on every rank."""
    global _POST_HOOK
    for opt in _optimizers(state):
        if opt in _TRACKERS:
            continue
        if _POST_HOOK is None:
            _POST_HOOK = register_optimizer_step_post_hook(_after_step)
            if not getattr(torch.amp.GradScaler.step, "_trainguard", False):
                torch.amp.GradScaler.step = _scaler_step(torch.amp.GradScaler.step)  # type: ignore[method-assign]
        t = _TRACKERS[opt] = _Tracker()
        ref = weakref.ref(t)
        t.seen = _snapshot(opt)
        for p in _params(opt):
            refs = _BY_PARAM.get(id(p))
            if refs is None:
                refs = _BY_PARAM[id(p)] = []
                weakref.finalize(p, _forget, id(p))
            refs[:] = [r for r in refs if r() is not None] + [ref]


def pending(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names (``group[i]/param[j]``) of ``optimizer``'s parameters holding non-zero gradients
    written after its last ``step()`` (or a step its GradScaler skipped); [] when none, or when any
    is not finite and no GradScaler stepped it (then its skipped step cannot be told from a window
    whose micro-batch overflowed: taken for a skipped step, as before GradScaler steps were seen)."""
    t = _TRACKERS.get(optimizer)
    if t is None:
        return []
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in t.seen or not _written(p, t.seen[id(p)]):
                continue
            g = p.grad
            with torch.no_grad():
                local = g.to_local() if hasattr(g, "to_local") else g
                if local.layout is not torch.strided:  # a sparse embedding's: torch has no isfinite for it
                    local = local._values() if local.is_sparse else local.values()
                if not bool(torch.isfinite(local).all()):
                    if not t.scaled:
                        return []  # a step a GradScaler skipped: the loop zeroes them
                    out.append(f"group[{gi}]/param[{pi}]")  # an overflowed micro-batch of the window
                elif bool(local.any()):
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
            warn_each(  # at every such save: its text (the step) kept in no registry (userframe.py)
                f"trainguard: the save of step {step} comes after backward() but before {key!r}.step(): "
                f"{len(names)} parameter(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) hold "
                "gradients no step() used yet. Gradients are not saved, so a resume from this checkpoint loses "
                "them (the rest of a gradient-accumulation window would start without its earlier micro-batches) "
                "and does not continue bit-identically. Call mgr.save(step, state) after optimizer.step(), at "
                "the end of an accumulation window (docs/checkpoints.md#what-is-saved)",
                PendingGradientsWarning,
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
