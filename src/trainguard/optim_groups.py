"""What an optimizer entry's refusal says when the checkpoint holds another number of parameter
groups than the optimizer: which groups differ, by their parameters' names (and their ``"name"``
key, when the user set one), and what to change. A group added during training with
``optimizer.add_param_group()`` (progressive unfreezing of a backbone) is the usual cause: the
resumed process builds the optimizer as at the start of the run, and must add that group again
before the load. ``stateful.OptimizerAdapter._match_groups`` (every rank, before anything is read
into the state) calls :func:`count_mismatch`; it and ``fsdp1.FSDP1OptimizerAdapter.check_saved`` call
:func:`refuse_other_class`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SHOWN = 4  # parameter names shown per group


def _describe(index: int, names: Sequence[str], group: Mapping[str, Any]) -> str:
    label = group.get("name")
    named = f" ({label!r})" if type(label) is str else ""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"group {index}{named} holds {list(names[:SHOWN])}{more}"


def count_mismatch(saved_groups: Sequence[Mapping[str, Any]], names: Sequence[str], groups: Sequence[Mapping[str, Any]]) -> str:
    """The message for ``saved_groups`` (the checkpoint's, parameters by name) against the
    optimizer's ``groups``, whose parameters are named ``names`` (flat, in group order)."""
    cur, pos = [], 0
    for g in groups:
        cur.append(list(names[pos : pos + len(g["params"])]))
        pos += len(g["params"])
    saved_sets, cur_sets = [set(g["params"]) for g in saved_groups], [set(c) for c in cur]
    parts = [f"the checkpoint has {len(saved_groups)} parameter group(s), the optimizer {len(groups)}"]
    only_saved = [_describe(i, g["params"], g) for i, g in enumerate(saved_groups) if saved_sets[i] not in cur_sets]
    only_cur = [_describe(i, c, g) for i, (c, g) in enumerate(zip(cur, groups)) if cur_sets[i] not in saved_sets]
    if only_saved:
        parts.append(f"the checkpoint's {'; '.join(only_saved[:3])}, which no group of the optimizer holds")
    if only_cur:
        parts.append(f"the optimizer's {'; '.join(only_cur[:3])}, which no group of the checkpoint holds")
    if len(saved_groups) > len(groups):
        parts.append(
            "a group added during training with optimizer.add_param_group() (unfreezing a backbone) must be added "
            "again, with the same parameters and in the same order, before the load (with a CheckpointManager: "
            "`if (mgr.latest_step() or -1) >= unfreeze_step: optimizer.add_param_group(...)` before `mgr.restore(state)`); "
            "build the optimizer with the same groups as when it was saved"
        )
    else:
        parts.append(
            "build the optimizer with the same groups as when it was saved (a group that the run adds with "
            "optimizer.add_param_group() at a later step than this checkpoint's is added after the load, at that step)"
        )
    return "; ".join(parts)


def left_out_hint(saved: Sequence[str], current: Sequence[str]) -> str:
    """``stateful.OptimizerAdapter._match_groups`` (every rank, before anything is read), for a
    group whose parameters differ from the checkpoint's: the names the checkpoint's group holds
    and the optimizer's lacks, and the usual reason, a layer frozen since the save and an optimizer
    built from the trainable parameters only (``filter(lambda p: p.requires_grad, ...)``); "" when
    the optimizer lacks none."""
    lacks = [n for n in saved if n not in set(current)]
    if not lacks:
        return ""
    return (f"; the checkpoint's group holds {lacks[:8]}{' ...' if len(lacks) > 8 else ''}, which the optimizer's lacks: "
            "if they are frozen since the save (requires_grad=False) and the optimizer is built from the trainable "
            "parameters only, build it from all of them as at save time (a frozen parameter gets no gradient, so the "
            "optimizer does not step it), or leave the optimizer out of the state and restore with strict=False to "
            "start it fresh")


def unowned_hint(params: Sequence[Any], names: Mapping[int, str]) -> str:
    """``stateful.OptimizerAdapter._match_groups`` (every rank, before anything is read), for a
    group whose parameters differ from the checkpoint's: why, when some of ``params`` belong to no
    module of the state (``names``: ``id(param) -> name``), else "". Such a parameter is named
    ``param.<index>``, which no checkpoint saved with its model holds. The usual cause: the
    optimizer was built on a model under ``torch.device("meta")`` before ``module.to_empty()``,
    which gives the module new parameters (torch's own load then steps the stale meta tensors and
    the model never trains)."""
    lost = [p for p in params if id(p) not in names]
    if not lost:
        return ""
    meta = sum(1 for p in lost if getattr(p, "is_meta", False))
    why = (
        f"{meta} of them on the meta device: the optimizer was built before module.to_empty(), which gives the "
        "module new parameters; build the optimizer after to_empty()"
        if meta
        else "the module's parameters were replaced after the optimizer was built (module.to_empty(), "
        "load_state_dict(assign=True), re-wrapping), or its module is not in the state; build the optimizer "
        "from the parameters of the module in the state"
    )
    return f"; {len(lost)} of the optimizer's parameters (named param.<index>) belong to no module in the state ({why})"


def a(name: str) -> str:
    """``name`` with its indefinite article, for messages: "an Adam", "a SGD" (by its first letter)."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def refuse_other_class(optimizer: Any, skeleton: Any, where: str) -> None:
    """Every rank, before anything is read (``OptimizerAdapter.check_saved``,
    ``FSDP1OptimizerAdapter.check_saved``): a permanent ``CheckpointError`` when the checkpoint
    holds another optimizer class's state (Adam's into SGD loaded, then failed at the first
    ``step()``; into RAdam it trained on). ``where`` prefixes the message (``"entry 'optim': "``).
    Checkpoints from before the class was saved hold none: not checked."""
    from .errors import CheckpointError
    from .permanent import mark  # each refusal: the same at every restart
    from .stateful import optimizer_class

    saved = skeleton.get("class") if isinstance(skeleton, dict) else None
    if isinstance(saved, str) and saved != (cur := optimizer_class(optimizer)):
        raise mark(CheckpointError(
            f"{where}the checkpoint holds the state of {a(saved)} optimizer, the state's optimizer is {a(cur)}; "
            f"build {a(saved)} as at save time (to start a new optimizer instead, leave this entry out of "
            "the state and load with strict=False)"
        ))
