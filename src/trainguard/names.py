"""Parameter names without the wrapper modules torch inserts between a module and its parent:
``torch.compile`` (``_orig_mod``), activation checkpointing and CPU offload (``checkpoint_wrapper``,
``offload_wrapper``: ``_checkpoint_wrapped_module``) and FSDP1 (``_fsdp_wrapped_module``).

A module's ``state_dict()`` leaves them out (their hooks strip them), ``named_parameters()`` does
not. ``stateful.ModuleAdapter`` names parameters without them, so an optimizer's state is keyed
alike whether or not a run wraps its layers: a run resumed with activation checkpointing turned on
or off loads its optimizer. Checkpoints written before this (their optimizer names kept
``_checkpoint_wrapped_module``) still load: ``loader._load`` passes their optimizer skeletons
through :func:`canonical_optimizer` and :func:`alias_saved_paths`.

It also records and checks ``requires_grad`` (:func:`frozen_names`, :func:`check_frozen`), and
records each submodule's format version (:func:`module_versions`, :func:`saved_metadata`).
"""

from __future__ import annotations

from typing import Any

WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
WRAPPERS_ANY = "\0".join(sorted(WRAPPERS))  # holds every wrapper part: canonical_names looks at each name


def canonical_key(key: str) -> str:
    """A dotted name (``layers.0._checkpoint_wrapped_module.attn.weight``) without wrapper parts."""
    return ".".join(p for p in key.split(".") if p not in WRAPPERS) if _wrapped(key) else key


# torch's wrapper classes (module, class): their instances hold the wrapped module as a child
# named in WRAPPERS. Looked up only in modules already imported: no instance exists otherwise.
_WRAPPER_CLASSES = (
    ("torch._dynamo.eval_frame", "OptimizedModule"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
)


def is_torch_wrapper(module: Any, attr: str) -> bool:
    """Whether ``module`` is one of torch's wrappers holding the wrapped module as ``attr``
    (``torch.compile``'s ``OptimizedModule``, ``checkpoint_wrapper``, FSDP1), not a user's
    module that happens to have a child of that name."""
    import sys

    if attr not in getattr(module, "_modules", {}):
        return False
    classes = [getattr(sys.modules.get(m), c, None) for m, c in _WRAPPER_CLASSES]
    return isinstance(module, tuple(c for c in classes if isinstance(c, type)))


def check_wrapper_names(module: Any) -> Any:
    """``stateful.ModuleAdapter`` (every save and load of a module entry, every rank): ``module``,
    refused when a user's module in it has a child named like a wrapper's (``_orig_mod``...):
    parameter names drop such parts, so two different parameters could get one name."""
    for name, mod in module.named_modules(remove_duplicate=False):
        for attr in WRAPPERS & set(getattr(mod, "_modules", {})):
            if not is_torch_wrapper(mod, attr):
                from .errors import UnsupportedValueError

                where = f"{name}.{attr}" if name else attr
                raise UnsupportedValueError(
                    f"module {type(mod).__name__} has a child named {attr!r} ({where!r}): trainguard removes that "
                    f"name from parameter names, as torch's wrappers put it there ({', '.join(sorted(WRAPPERS))}). "
                    "Rename the child.")
    return module


def canonical_names(module: Any, names: list[str]) -> list[str]:
    """``stateful.ModuleAdapter`` (every save and load of a module entry, every rank): each of
    ``module``'s ``names`` without wrapper parts; where a name holds one, the module is checked
    first (:func:`check_wrapper_names`): a walk of every submodule, so only then (1.4 ms for
    2,000 modules per walk, on every save's stall)."""
    try:  # one scan of all the names at C speed: no wrapper part in any (the common case) leaves them as they are
        joined = "\0".join(names)
    except TypeError:  # a name that is no str: each is looked at below
        joined = WRAPPERS_ANY
    if not any(w in joined for w in WRAPPERS):
        return names
    out = [canonical_key(n) for n in names]
    if out != names:
        check_wrapper_names(module)
    return out


def _wrapped(name: Any) -> bool:
    return type(name) is str and any(w in name for w in WRAPPERS)


def canonical_optimizer(skel: Any) -> Any:
    """``loader._load``, every rank, for an optimizer entry's saved skeleton: its ``state`` keys
    and its groups' ``params`` without wrapper parts. The same object when no name holds one
    (every checkpoint written since names dropped them); a new one otherwise (the manifest's
    objects are not changed)."""
    if type(skel) is not dict:
        return skel
    state, groups = skel.get("state"), skel.get("param_groups")
    groups = groups if type(groups) is list else []
    names = [*(state if type(state) is dict else ()),
             *(n for g in groups if type(g) is dict and type(g.get("params")) is list for n in g["params"])]
    if not any(_wrapped(n) for n in names):
        return skel
    out = dict(skel)
    if type(state) is dict:
        out["state"] = {canonical_key(k) if type(k) is str else k: v for k, v in state.items()}
    if groups:
        out["param_groups"] = [
            {**g, "params": [canonical_key(n) if type(n) is str else n for n in g["params"]]}
            if type(g) is dict and type(g.get("params")) is list else g
            for g in groups
        ]
    return out


def alias_saved_paths(refs: list[str], dest: dict[str, Any]) -> dict[str, Any]:
    """``loader._load``, after :func:`canonical_optimizer`: ``dest`` (tensor path -> the state's
    tensor, named without wrappers) with each saved path that holds a wrapper part (``refs``)
    pointing to the tensor of its canonical path, so such a tensor is read in place (a DTensor
    shard too) rather than into a new one."""
    for p in refs:
        if _wrapped(p) and p not in dest:
            c = "/".join(canonical_key(s) for s in p.split("/"))
            if c in dest:
                dest[p] = dest[c]
    return dest


def frozen_names(module: Any) -> list[str]:
    """``capture.capture`` (every rank, each module entry of a save that is not rank-local nor
    ``split_state``) and :func:`check_frozen`: the names of ``module``'s parameters with
    ``requires_grad=False``, as its optimizer state names them, sorted; saved beside the entry's
    skeleton as ``"frozen"``."""
    from .stateful import unwrap_module
    from .walks import named_parameters

    # named_parameters()'s names (a tie by its first name), from the walk the save's call already took
    # for the optimizer's names (walks.py): each parameter's first name in named_parameters(remove_duplicate=False).
    seen: set[int] = set()
    out = set()
    for n, p in named_parameters(unwrap_module(module)):
        if id(p) not in seen:
            seen.add(id(p))
            if not p.requires_grad:
                out.add(canonical_key(n))
    return sorted(out)


def check_frozen(manifest: Any, state: Any) -> None:
    """``loader._load`` (through ``schedclass.check_entries``), every rank, after the load was planned: warn when a module entry's
    parameters were frozen (``requires_grad=False``) at save time and are trainable now, or the
    reverse. Only for a resume (the state holds an optimizer too: a fine-tuning that loads the
    weights alone may freeze others on purpose) and checkpoints that recorded it. A checkpoint
    restores values, not ``requires_grad``: a loop that unfreezes a backbone at ``step == K`` and
    resumes past K trains on with it frozen, silently (torch does not save the flag either)."""
    import warnings

    import torch

    from .userframe import user_stacklevel

    if not any(isinstance(v, torch.optim.Optimizer) for v in state.values()):
        return
    for key, value in state.items():
        entry = manifest.objects.get(key) or {}
        saved = entry.get("frozen") if isinstance(value, torch.nn.Module) else None
        if type(saved) is not list or not all(type(n) is str for n in saved):  # absent (older), or damaged: no check
            continue
        from .stateful import unwrap_module

        params = {canonical_key(n) for n, _ in unwrap_module(value).named_parameters()}
        # Only the parameters the checkpoint holds (its skeleton, by the same names): one added
        # since the save (a strict=False load) had no requires_grad then to differ from.
        held = set(entry["skeleton"]) if type(entry.get("skeleton")) is dict else params
        was, now = set(saved) & params, set(frozen_names(value)) & (held | set(saved))
        thawed, froze = sorted(was - now), sorted(now - was)
        if thawed or froze:
            parts = [f"{len(v)} {what}: {v[:6]}" for v, what in ((thawed, "were frozen then and are trainable now"),
                                                                 (froze, "were trainable then and are frozen now")) if v]
            warnings.warn(
                f"entry {key!r}: parameters that differ in requires_grad from the checkpoint of step {manifest.step}: "
                f"{'; '.join(parts)}. A checkpoint restores values, not requires_grad: if your loop freezes or "
                "unfreezes parameters at some step, apply that again on resume (e.g. `if step >= unfreeze_step`); "
                "ignore this if the change is on purpose",
                stacklevel=user_stacklevel(),  # the caller of tg.load or restore (a fixed 6 named userload.py)
            )


def _wraps(mod: Any) -> bool:
    # Not set(mod._modules): a torch.jit.script module's is an OrderedModuleDict, which has no __iter__ (KeyError: 0).
    return any(is_torch_wrapper(mod, attr) for attr in WRAPPERS)


def module_versions(module: Any, metadata: Any = None) -> dict[str, int]:
    """``capture.capture`` (every rank, each module entry of a save that is not rank-local nor
    ``split_state``): each submodule's ``_version`` (the format of its own ``state_dict()``,
    which ``torch.save`` keeps in the dict's ``_metadata``) that is not ``nn.Module``'s 1, by its
    name without wrapper parts (``""``: the entry's module). Saved beside the entry's skeleton as
    ``"versions"``; :func:`saved_metadata` hands them to the module's load. ``metadata``: the
    ``_metadata`` of the ``state_dict()`` the capture took (``ModuleAdapter.metadata``), read
    instead of a walk of every submodule (24 ms a save for 12,501 modules, 3,125 of them versioned BatchNorms;
    this scan 4.6 ms). torch's
    wrappers are at version 1: the entries of the modules they wrap are the ones kept."""
    if isinstance(metadata, dict):
        got = [(n, m.get("version", 1)) for n, m in metadata.items() if isinstance(m, dict) and m.get("version", 1) != 1]
        return {canonical_key(n): v for n, v in got if type(n) is str and type(v) is int}
    from .stateful import unwrap_module

    out: dict[str, int] = {}
    for name, mod in unwrap_module(module).named_modules(remove_duplicate=False):
        v = getattr(mod, "_version", 1)
        if v != 1 and type(v) is int and not _wraps(mod):
            out[canonical_key(name)] = v
    return out


def saved_metadata(module: Any, current: Any, saved: Any, keys: Any = ()) -> Any:
    """``stateful.ModuleAdapter.load_state_dict`` (every rank, each module entry loaded): the
    ``_metadata`` to load ``module`` (unwrapped) with: ``current`` (its own ``state_dict()``'s)
    with each submodule's version as the checkpoint recorded it (``saved``, the entry's
    ``"versions"``; a submodule not in it was at 1). A module whose version grew since the save
    (a torch upgrade) then upgrades the saved values in its ``_load_from_state_dict``, as it does
    for a ``torch.save``d state dict. A submodule none of whose ``keys`` (the module's names of the
    values loaded) the checkpoint holds keeps its current version: added since the save
    (``strict=False``), it has no saved values to upgrade (a quantization observer given version 1
    reset its ``eps``). ``current`` as it is when the checkpoint recorded none (written before
    session 43, or damaged): the module's versions are taken for the saved ones."""
    if type(saved) is not dict or not all(type(k) is str and type(v) is int for k, v in saved.items()):
        return current
    from collections import OrderedDict

    # Only the modules whose version differs are looked at further: a walk of every submodule cost
    # 120 ms a load for 12,501 modules; this scan of the names 10-20 ms.
    change = {n: v for n, local in (current or {}).items()
              if isinstance(local, dict) and local.get("version") != (v := saved.get(canonical_key(n), 1))}
    out = OrderedDict(current or {})
    if not change:
        return out
    held = {""}
    for k in keys:
        parts = k.split(".")
        held.update(".".join(parts[:i]) for i in range(1, len(parts)))
    mods = dict(module.named_modules(remove_duplicate=False))
    for name, v in change.items():
        if name in held and name in mods and not _wraps(mods[name]):
            out[name] = {**out[name], "version": v}
    return out
