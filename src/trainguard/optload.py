"""Loading an optimizer's per-parameter state where the live optimizer has no tensor to read into.

A freshly built optimizer has no state; one built with other hyperparameters (SGD without
momentum, Adam without ``amsgrad``) lacks some of it; one that has stepped while some parameters
were frozen or had no gradient lacks theirs. ``loader._load`` reads such a saved tensor into a
new one and hands it to ``optimizer.load_state_dict``. Two cases need more, and
:func:`fill_destinations` (called by ``loader._load`` on every rank, for each optimizer entry,
while it plans the load, before anything is read) handles them:

- the parameter is a DTensor (FSDP2) and the saved tensor has its (global) shape: a new whole
  tensor would put the full state on every rank, and the next ``step()`` fails mixing a plain
  tensor with DTensors. The destination is a DTensor sharded like the parameter
  (``torch.empty_like``), so each rank reads its shard (resharding as for any DTensor);
- the parameter is a DTensor and the saved tensor has another shape (a factored second moment:
  one value per row, ``[rows]``): a whole tensor fails the same way. The destination is a
  DTensor on the parameter's mesh placed as the save held it, as far as the manifest tells
  (:func:`saved_placements`: sharded along the dim its stored boxes split, else replicated);
- the saved tensor has the shape the parameter had at save time, and the parameter's shape has
  changed since: it is listed as mismatched, like the module's tensor (a strict load refuses;
  ``strict=False`` leaves that parameter without optimizer state, :func:`without_unread`, so its
  next ``step()`` starts it afresh, instead of failing on the old shape).

A scalar (Adam's ``step``) and the state of a plain (non-DTensor) parameter are read into new
whole tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .dcp_import import saved_groups
from .dtensor import is_dtensor
from .flatten import tensor_refs
from .manifest import Manifest


def owners(adapter: Any, skel: Any) -> dict[str, tuple[str, Any]]:
    """Each tensor path of the saved optimizer entry ``skel`` (its per-parameter state) -> (the
    parameter's name in the checkpoint, the live parameter). Empty for a skeleton of another
    form (torch's own, keyed by index) or groups that do not match (``check_saved`` refused those)."""
    state = skel.get("state") if isinstance(skel, dict) else None
    groups = saved_groups(adapter, skel, warn=False)
    if not isinstance(state, dict) or "$dict" in state or not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(type(n) is str for n in g["params"])
            for g in groups):
        return {}
    try:
        per_group = adapter._match_groups(groups, warn=False)
    except Exception:  # noqa: BLE001 - groups that differ: check_saved and load_state_dict say so
        return {}
    by_name = {n: p for names, g in zip(per_group, adapter.optimizer.param_groups, strict=True)
               for n, p in zip(names, g["params"], strict=True)}
    out: dict[str, tuple[str, Any]] = {}
    for name, st in state.items():
        if (p := by_name.get(name)) is not None:
            for ref in tensor_refs(st):
                out[ref] = (name, p)
    return out


def saved_param_shape(manifest: Manifest, name: str) -> list[int] | None:
    """The shape parameter ``name`` (the optimizer's name for it) had at save time, from a module
    entry of the checkpoint: ``<entry>/<name>``, or ``<entry>/<rest>`` for a name ``<entry>.<rest>``
    (a state with several modules); None when no module entry holds it."""
    for key in manifest.objects:
        for path in (f"{key}/{name}", f"{key}/{name[len(key) + 1:]}" if name.startswith(key + ".") else None):
            if path is not None and (e := manifest.tensors.get(path)) is not None:
                return e.shape
    return None


def fill_destinations(adapter: Any, skel: Any, dest: dict[str, Any], manifest: Manifest,
                      mismatched: list[str], bad: dict[str, str]) -> None:
    """``loader._load``: the saved per-parameter tensors that have no destination in ``dest``
    (tensor path -> the live state's tensor) get a DTensor one when their parameter is a DTensor,
    or are added to ``mismatched`` and ``bad`` when their parameter's shape has changed since
    the save (see the module's docstring)."""
    for p, (name, param) in owners(adapter, skel).items():
        e = manifest.tensors.get(p)
        if dest.get(p) is not None or e is None or not e.shape:  # one to read into; a scalar ("step")
            continue
        if e.shape == list(param.shape):
            if is_dtensor(param):
                dest[p] = torch.empty_like(param.detach(), dtype=e.torch_dtype)
        elif saved_param_shape(manifest, name) == e.shape:
            bad[p] = (f"{p} (checkpoint {e.dtype}{e.shape}: the state of parameter {name!r}, whose shape is "
                      f"{list(param.shape)} now)")
            mismatched.append(bad[p])
        elif is_dtensor(param):
            from torch.distributed.tensor import empty

            dest[p] = empty(e.shape, dtype=e.torch_dtype, device_mesh=param.device_mesh,
                            placements=saved_placements(e, param, manifest.world_size))


def saved_placements(e: Any, param: Any, world_size: int) -> list[Any]:
    """``fill_destinations``: placements on DTensor ``param``'s mesh for its saved state tensor
    ``e`` (a manifest entry of another shape than the parameter's). Each mesh dim that shards the
    parameter shards the state along the next tensor dim that the stored boxes split (a regular
    entry's dim, or where the chunks do not span the whole tensor); a single whole box, saved by
    several ranks, was replicated. A single box saved by one rank tells nothing: the state is
    sharded along the parameter's dim where it has the parameter's size there, else replicated.
    A mesh dim that replicates the parameter replicates its state."""
    from torch.distributed.tensor import Replicate, Shard

    if e.regular is not None:
        dims = [e.regular.dim]
    else:
        dims = sorted({d for c in e.chunks for d, (n, full) in enumerate(zip(c.sizes, e.shape, strict=True)) if n < full})
    out: list[Any] = []
    for pl in param.placements:
        d = getattr(pl, "dim", None)  # Shard and _StridedShard
        if d is None:
            out.append(Replicate())
        elif dims:
            out.append(Shard(dims.pop(0)))
        elif world_size == 1 and d < len(e.shape) and e.shape[d] == param.shape[d]:
            out.append(Shard(d))
        else:
            out.append(Replicate())
    return out


def without_unread(adapter: Any, skel: Any, value: Any, dest: dict[str, Any], bad: dict[str, str]) -> Any:
    """``loader._load``, ``strict=False``: the optimizer entry's loaded ``value`` without the state
    of each parameter that has a tensor in ``bad`` with nothing in its place (not read, no live
    tensor kept): that parameter starts its state afresh at its next ``step()``."""
    own = owners(adapter, skel)
    drop = {own[p][0] for p in bad if p in own and dest.get(p) is None}
    if not drop or not isinstance(value, dict) or not isinstance(value.get("state"), dict):
        return value
    return {**value, "state": {n: s for n, s in value["state"].items() if n not in drop}}


def keep_whole(adapter: Any, skel: Any, bad: dict[str, str]) -> None:
    """``loader._load`` (every rank, for each optimizer entry, once its tensors are planned, before
    anything is read): a parameter with a state tensor in ``bad`` (its shape changed since the save)
    gets its other saved state tensors (Adam's ``step``) added to ``bad`` too, so none of them is
    read: with ``strict=False`` an optimizer that has state for it keeps that state whole (before, it
    kept its moments and took the checkpoint's ``step``: a bias correction for other moments), and one
    that has none starts it afresh (:func:`without_unread`)."""
    own = owners(adapter, skel)
    reshaped = {own[p][0] for p in bad if p in own}
    for p, (name, _param) in own.items():
        if name in reshaped and p not in bad:
            bad[p] = f"{p} (kept with the state of parameter {name!r}, whose shape changed)"


def keep_scalar_dtypes(optimizer: Any, groups: list[dict[str, Any]], state: Mapping[Any, Any]) -> None:
    """``stateful.OptimizerAdapter.load_state_dict`` (every rank, each optimizer entry), right after
    ``optimizer.load_state_dict`` with the saved ``groups`` (their ``params``: the ids of ``state``'s
    keys, in the live optimizer's parameter order) and per-parameter ``state``: each 0-dim
    floating-point state tensor other than ``step`` back to its saved dtype. torch's load casts every
    such tensor to its parameter's dtype, so NAdam's ``mu_product`` and ASGD's ``eta``/``mu`` (created
    in float32 whatever the parameters are) became float64 or bfloat16 on resume, and a run of float64
    parameters resumed with other numbers than the run that went on. Optimizers whose class overrides
    ``load_state_dict`` are left as torch's own rules made them (their own rules)."""
    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for i, p in zip(ids, params):
        saved, live = state.get(i), optimizer.state.get(p)
        if not isinstance(saved, Mapping) or not isinstance(live, dict):
            continue
        for k, v in live.items():
            s = saved.get(k)
            if (k != "step" and isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor) and v.dim() == 0
                    and s.dim() == 0 and s.dtype != v.dtype and s.is_floating_point() and v.is_floating_point()):
                live[k] = v.to(s.dtype)
