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
    parts.append(FRESH)  # before review58b a fine-tune's new optimizer (other groups) was only told to rebuild the old one
    return "; ".join(parts)


FRESH = ("or, to start a new optimizer (a fine-tune from this checkpoint, new parameter groups), leave it out of the "
         "load: tg.load(path, state, only=[the other entries, e.g. 'model']), or out of the state with strict=False")


def left_out_hint(saved: Sequence[str], current: Sequence[str]) -> str:
    """``stateful.OptimizerAdapter._match_groups`` (every rank, before anything is read), for a
    group whose parameters differ from the checkpoint's: the names the checkpoint's group holds
    and the optimizer's lacks, and the usual reason, a layer frozen since the save and an optimizer
    built from the trainable parameters only (``filter(lambda p: p.requires_grad, ...)``); "" when
    the optimizer lacks none."""
    lacks = [n for n in saved if n not in set(current)]
    if not lacks:
        return ""
    return (f"; the checkpoint's group holds {lacks[:8]}{' ...' if len(lacks) > 8 else ''}, "
            "which the optimizer's lacks (removed from the model since the save, or left out of the optimizer): "
            "if they are frozen since the save (requires_grad=False) and the optimizer is built from the trainable "
            "parameters only, build it from all of them as at save time (a frozen parameter gets no gradient, so the "
            "optimizer does not step it); else build the model and the optimizer as at save time, or leave the "
            "optimizer out of the state and restore with strict=False to start it fresh")


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


def worlds(adapter: Any) -> tuple[int, int]:
    """The loading and the saving world size of ``adapter``'s load (``rankload.split_hint``): the
    manifest ``loader._load`` gave its ``check_saved``, or this process group's for both."""
    from .dist import DistContext

    world = DistContext.current().world_size
    manifest = getattr(adapter, "_manifest", None)
    return world, manifest.world_size if manifest is not None else world


def ties(adapter: Any) -> tuple[dict[str, str], dict[str, str]]:
    """``(saved, now)`` for :func:`other_params`: each parameter name that was a later name of a
    tie at save time (``lm_head.weight`` IS ``wte.weight``: an alias in the manifest) -> its first
    name, and each name that is another name of one of ``adapter``'s parameters now -> the name
    the optimizer keys it by. Both spelt with and without the entry's key."""
    saved: dict[str, str] = {}
    manifest = getattr(adapter, "_manifest", None)
    for p, e in (manifest.tensors.items() if manifest is not None else ()):
        if e.alias is not None and "/" in p and "/" in e.alias:
            (key, rest), (tkey, trest) = p.split("/", 1), e.alias.split("/", 1)
            saved[rest], saved[f"{key}.{rest}"] = trest, f"{tkey}.{trest}"
    now = {n: first for pid, names in adapter.name_choices.items() if (first := adapter.names.get(pid)) is not None
           for n in names if n != first}
    return saved, now


def _tie_lines(added: list[str], removed: list[str], saved: list[str], tied: tuple[dict[str, str], dict[str, str]]) -> str:
    """:func:`other_params`' lines for the parameters it would call added or removed that are a tie
    changed since the save (the model tied or untied since then); "" when none is."""
    was, now = tied
    untied = [(n, was[n]) for n in added if was.get(n) in saved]
    retied = [(n, now[n]) for n in removed if now.get(n) is not None]
    out = ""
    if untied:
        n, first = untied[0]
        out += (f"; tied at save time (one parameter, its state under the first name), two parameters in the state's "
                f"model: {', '.join(f'{a!r} to {b!r}' for a, b in untied[:SHOWN])}: tie them again before the load, as "
                f"at save time (module.{n} = module.{first}), or leave the optimizer out of the state and restore with "
                "strict=False to start it fresh")
    if retied:
        out += (f"; two parameters at save time, tied in the state's model (one parameter): "
                f"{', '.join(f'{a!r} to {b!r}' for a, b in retied[:SHOWN])}: build the model untied, as at save time, "
                "or leave the optimizer out of the state and restore with strict=False to start it fresh")
    return out


def other_params(gi: int, saved_groups: Sequence[Mapping[str, Any]], current: Sequence[Sequence[str]],
                 tied: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> str:
    """``stateful.OptimizerAdapter._match_groups`` and ``fsdp1.FSDP1OptimizerAdapter.check_saved``
    (every rank, before anything is read), for parameter group ``gi``, the first whose parameters
    differ from the checkpoint's (the same number of groups): what happened and what to change.
    ``current``: each optimizer group's parameter names, spelt as the checkpoint's would be.

    - the same groups in another order (torch matches groups by position): which is which;
    - the same parameters, grouped otherwise: which parameter moved between which groups;
    - as many parameters, other names (a module attribute or an entry key renamed): a few pairs;
    - a tie made or undone since the save (``tied``: :func:`ties`): which names;
    - parameters added or removed since the save: which (:func:`left_out_hint` for the removed ones)."""
    saved_sets, cur_sets = [frozenset(g["params"]) for g in saved_groups], [frozenset(c) for c in current]
    saved, cur = list(saved_groups[gi]["params"]), list(current[gi])
    head = f"parameter group {gi} holds other parameters than at save time"
    if sorted(map(sorted, saved_sets)) == sorted(map(sorted, cur_sets)):
        pairs = [f"the checkpoint's group {i} is the optimizer's group {cur_sets.index(s)}"
                 for i, s in enumerate(saved_sets) if cur_sets[i] != s]
        return (f"{head}: the optimizer holds the same parameter groups in another order ({'; '.join(pairs[:SHOWN])}); "
                "torch matches groups by position: build the parameter groups in the order of save time")
    if frozenset().union(*saved_sets) == frozenset().union(*cur_sets):
        where = {n: i for i, s in enumerate(saved_sets) for n in s}
        now = {n: i for i, s in enumerate(cur_sets) for n in s}
        moved = [f"{n!r} (checkpoint group {where[n]}, optimizer group {now[n]})"
                 for n in (*saved, *cur) if where.get(n) != now.get(n)]
        moved = list(dict.fromkeys(moved))
        return (f"{head}: the same parameters, grouped otherwise: {', '.join(moved[:SHOWN])}"
                f"{' ...' if len(moved) > SHOWN else ''}; build each group with the parameters it held at save time")
    removed = [n for n in saved if n not in set(cur)]
    added = [n for n in cur if n not in set(saved)]
    if tie := _tie_lines(added, removed, saved, tied):  # before session 56: "added to the model", "removed from" it
        return head + tie
    if removed and len(removed) == len(added) and len(saved) == len(cur):
        pairs = [f"{a!r} -> {b!r}" for a, b in zip(removed, added, strict=True)]
        return (f"{head}: {len(pairs)} of its {len(cur)} parameters have other names (checkpoint -> optimizer, in "
                f"group order): {', '.join(pairs[:SHOWN])}{' ...' if len(pairs) > SHOWN else ''}; a module attribute or "
                "a module entry key of the state renamed since the save: give them their names of save time (the "
                "optimizer's state is keyed by parameter name)")
    out = head
    if added:
        out += (f"; the optimizer's group holds {len(added)} parameter(s) {added[:8]}{' ...' if len(added) > 8 else ''}, "
                "which the checkpoint's lacks (added to the model since the save): build the optimizer over the "
                "parameters of save time and add the new ones after the load (optimizer.add_param_group()), or leave "
                "the optimizer out of the state and restore with strict=False to start it fresh")
    return out + left_out_hint(saved, cur)


def index_groups(saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]) -> str:
    """``stateful.OptimizerAdapter.check_saved`` (every rank, before anything is read), for an
    optimizer entry in torch's own form (parameters by index: a ``torch.save`` file imported by
    ``convert``), which loads by position: why its groups cannot load into ``groups`` (another
    number of groups, or of parameters in a group), or "". Torch's ``load_state_dict`` refuses
    these too, but only once the load has read the other entries into the state."""
    saved_n, cur_n = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in groups]
    if saved_n == cur_n:
        return ""
    return (f"the checkpoint's optimizer state is keyed by parameter position (torch's own form, as imported from a "
            f"torch.save file), with {len(saved_n)} parameter group(s) of {saved_n} parameters; the optimizer has "
            f"{len(cur_n)} group(s) of {cur_n}: build the optimizer with the same groups, over the same parameters "
            "in the same order, as the one that saved it (or leave it out of the state and load with strict=False)")
