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

``capture.capture`` (save) and ``loader._load`` (load) call :func:`refuse_unsupported` for each
entry, on every rank, before anything is written or read. An optimizer over parameters of a
sharded FSDP1 model that is an entry of the same state gets :class:`FSDP1OptimizerAdapter`, and
so does one over unsharded flat parameters (``use_orig_params=False`` with ``NO_SHARD`` or on one
rank: its state was keyed by the flat parameters, ``0._flat_param``, which loaded into nothing but
the same wrapping; such checkpoints still load, as they were saved). Its load takes the names of
a state with one module entry or several (an EMA added or removed since the save), as
``stateful.OptimizerAdapter`` does, and refuses other names before anything is read
(torch.distributed.checkpoint's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` with
``full_state_dict=True``: whole tensors by name, the entries of a plain optimizer's). torch's
older ``FSDP.optim_state_dict``/``optim_state_dict_to_load`` are not used: with
``use_orig_params=True`` their round trip did not give the optimizer its ``exp_avg`` back (torch
2.13, 2 gloo CPU ranks). Refused with what to change: such an optimizer without its model in the
state, and an FSDP1 model under a ``state_dict_type`` other than a full one on every rank
(``SHARDED_STATE_DICT``: ShardedTensors; ``LOCAL_STATE_DICT``: flat shards; ``rank0_only=True``:
nothing on the other ranks). Nothing here imports torch.distributed.fsdp: a state holds FSDP1
only when the user imported it.
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
    from .walks import modules

    out = []
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for sub in modules(value):  # the save call's one walk of the module (walks.py)
                handle = getattr(sub, "_handle", None) if isinstance(sub, fsdp) else None
                if handle is not None and getattr(handle, "flat_param", None) is not None:
                    out.append((sub, handle.flat_param))
    return out


def _strategy(module: Any) -> str:
    s = getattr(module, "sharding_strategy", None)
    return getattr(s, "name", None) or str(s)


def refuse_unsupported(value: Any, key: str, state: Any, saving: bool) -> FSDP1OptimizerAdapter | None:
    """``capture.capture`` and ``loader._load``, every rank, for entry ``key`` of ``state``, before
    anything is written or read: ``zero.refuse_partitioned`` for an optimizer, then FSDP1's checks
    (:func:`refuse_fsdp1`). Returns the adapter to use instead of ``stateful.adapt``'s for an
    optimizer over a sharded FSDP1 model entry of ``state``; None for anything else."""
    if isinstance(value, torch.optim.Optimizer):
        refuse_partitioned(value, key, saving)  # ZeroRedundancyOptimizer: its state_dict() raises on most ranks
    return refuse_fsdp1(value, key, state, saving)


def refuse_fsdp1(value: Any, key: str, state: Any, saving: bool) -> FSDP1OptimizerAdapter | None:
    """For entry ``key`` of ``state`` (:func:`refuse_unsupported`): an optimizer over parameters
    of a sharded FSDP1 model gets a :class:`FSDP1OptimizerAdapter` when the model is one module
    entry of ``state`` holding all its parameters, else ``UnsupportedValueError``; a module
    holding an FSDP1 module whose ``state_dict()`` would not give full tensors on every rank
    raises it too. Nothing (and nothing is imported) when FSDP1 was never imported."""
    if _FSDP_MODULE not in sys.modules:
        return None
    verb = "save" if saving else "load"
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer(value, key, state, verb)
    if isinstance(value, torch.nn.Module):
        _refuse_module(value, key, verb)
    return None


def _optimizer(optimizer: torch.optim.Optimizer, key: str, state: Any, verb: str) -> FSDP1OptimizerAdapter | None:
    flat_cls = getattr(sys.modules.get(_FLAT_MODULE), "FlatParameter", ())
    sharded: dict[int, Any] = {}  # id(param) -> its FSDP1 module, for sharded flat parameters
    known: set[int] = set()  # every FSDP1 parameter of the state's modules
    handles = _handles(state)  # one walk of the modules (a save's call pays each)
    for sub, flat in handles:
        for p in [flat, *(getattr(flat, "_params", None) or ()), *(getattr(flat, "_shared_params", None) or ())]:
            known.add(id(p))
            if _sharded(flat):
                sharded[id(p)] = sub
    mine = [p for g in optimizer.param_groups for p in g["params"]]

    def fsdp1(p: Any) -> bool:  # sharded, or FSDP1's (it marks what it flattens) with no model here to tell
        flat = bool(flat_cls) and isinstance(p, flat_cls)
        return id(p) in sharded or (flat and _sharded(p)) or (
            id(p) not in known and getattr(p, "_fsdp_flattened", False) and type(p) in (torch.Tensor, torch.nn.Parameter))

    hit = next((p for p in mine if fsdp1(p)), None)
    flats = {id(flat) for _, flat in handles}
    flat = next((p for p in mine if id(p) in flats or bool(flat_cls) and isinstance(p, flat_cls)), None)
    if hit is None and flat is None:
        return None
    from .optnames import largest_owner

    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    owner = largest_owner(modules, {id(p) for p in mine})  # the entry param_name_map names them by
    if owner is not None:  # also unsharded flat parameters (NO_SHARD, 1 rank): by their parameters' names
        return FSDP1OptimizerAdapter(optimizer, modules[owner], f"{owner}." if len(modules) > 1 else "", owner, state)
    if hit is None:  # unsharded, and no model to name them: keyed by index (stateful.OptimizerAdapter warns)
        return None
    strategy = _strategy(sharded[id(hit)]) if id(hit) in sharded else "a sharded one"
    raise UnsupportedValueError(
        f"entry {key!r}: the optimizer holds parameters of a FullyShardedDataParallel (FSDP1) model with sharding "
        f"strategy {strategy}: each rank's optimizer state covers only its own shard of FSDP1's flattened parameters, "
        f"which trainguard can {verb} only through the model (torch.distributed.checkpoint's get/set_optimizer_state_dict, "
        "whole tensors by name): put the FSDP1 model that holds all of the optimizer's parameters in the same state "
        f"(state = {{'model': fsdp_model, {key!r}: optimizer}}). Or: {USE_FSDP2}"
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


class FSDP1OptimizerAdapter:
    """An optimizer over a sharded FSDP1 model, saved as whole tensors by parameter name
    (``get_optimizer_state_dict``, full, on every rank) keyed as ``stateful.OptimizerAdapter`` keys
    a plain optimizer (so it loads into FSDP2 or a plain model, on any world size), and loaded
    through ``set_optimizer_state_dict``, which gives each rank its shard. Both calls are
    collectives of the model's process group: every rank makes them, in the same order, in the
    caller's thread (``capture.capture``, ``loader._load``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, prefix: str, key: str = "",
                 state: Any = None) -> None:
        self.optimizer, self.model, self.prefix, self.key, self.state = optimizer, model, prefix, key, state

    def _named(self, fqn: Any) -> Any:
        return self.prefix + fqn if type(fqn) is str else fqn

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from .stateful import optimizer_class

        osd = get_optimizer_state_dict(self.model, self.optimizer, options=_full_options())
        params = {n for g in osd["param_groups"] for n in g["params"]}
        # an entry of optimizer.state that is no parameter's (a custom optimizer's own counter,
        # self.state["global_step"]) goes under "state_by_key", as stateful.OptimizerAdapter saves it:
        # set_optimizer_state_dict drops such a key (torch 2.13), so load_state_dict puts it back itself
        by_key = {k: v for k, v in osd["state"].items() if k not in params}
        return {
            "state": {self._named(k): v for k, v in osd["state"].items() if k in params},
            "param_groups": [{**g, "params": [self._named(n) for n in g["params"]]} for g in osd["param_groups"]],
            "class": optimizer_class(self.optimizer),
            **({"state_by_key": by_key} if by_key else {}),
        }

    def check_saved(self, skeleton: Any, key: str | None) -> None:
        """``loader._load``, every rank, before anything is read into the state (this check ran in
        ``load_state_dict``, at the entry's turn: a refused load left the model entries before it
        loaded): refuse the state of another optimizer class or another number of parameter groups."""
        from .errors import CheckpointError
        from .optim_groups import refuse_other_class
        from .permanent import mark

        where = f"entry {key!r}: " if key is not None else ""
        if (flat := self._flat_names(skeleton)) is not None:
            if key is not None:  # else load_state_dict's own check (_match_groups) says it
                flat.check_saved(skeleton, key)
            return
        refuse_other_class(self.optimizer, skeleton, where)
        groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
        if isinstance(groups, list) and len(groups) != len(self.optimizer.param_groups):
            raise mark(CheckpointError(
                f"{where}the checkpoint's optimizer has {len(groups)} parameter group(s), the state's "
                f"{len(self.optimizer.param_groups)}; build the optimizer with the parameter groups of save time"
            ))
        mine = self._group_fqns()
        if mine is None or not isinstance(groups, list) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list) and all(type(n) is str for n in g["params"])
                for g in groups):
            return
        fqn = self._fqn(skeleton)
        saved = [{**g, "params": [fqn(n) for n in g["params"]]} for g in groups]
        for gi, (g, cur) in enumerate(zip(saved, mine, strict=True)):
            if set(g["params"]) != set(cur):  # set_optimizer_state_dict refused it at the entry's turn, or loaded part
                from .optim_groups import other_params

                raise mark(CheckpointError(where + other_params(gi, saved, mine)))

    def _fqn(self, skeleton: Any) -> Any:
        """The saved names -> the model's own (get_optimizer_state_dict's): without the prefix of this
        state's spelling (the model's entry key, when the state holds several modules), or of the other
        (saved from a state with several modules, loaded into one with this model alone), whichever
        gives names the model has; an unprefixed name (saved from a state with one module) as it is."""
        names = _saved_names(skeleton)
        fqns = self._fqns()
        for head in dict.fromkeys((self.prefix, "", f"{self.key}." if self.key else "")):
            mapped = {n[len(head):] if head and n.startswith(head) else n for n in names}
            if fqns is None or mapped <= fqns:
                break
        else:
            head = self.prefix

        def fqn(name: Any) -> Any:
            return name[len(head):] if head and type(name) is str and name.startswith(head) else name

        return fqn

    def _param_fqns(self) -> dict[int, list[str]] | None:
        """``id(param) -> the names get_optimizer_state_dict gives its state`` (several for a flat
        parameter: those of the parameters it holds); None where torch's helper is not there."""
        out: dict[int, list[str]] = {}
        try:  # a private helper of torch's: where it is missing or fails, names are not checked before the load
            from torch.distributed.checkpoint.state_dict import _get_fqns

            for name, p in self.model.named_parameters():
                order = list(getattr(p, "_fqns", None) or ())  # a flat parameter's, in its order: a rename's pairs line up

                def pos(n: str, order: list[str] = order) -> tuple[int, str]:
                    return next((i for i, f in enumerate(order) if n == f or n.endswith("." + f)), len(order)), n

                out.setdefault(id(p), []).extend(sorted(_get_fqns(self.model, name), key=pos))
        except Exception:  # noqa: BLE001 - set_optimizer_state_dict checks the names at the entry's turn, as before
            return None
        return out

    def _fqns(self) -> set[str] | None:
        named = self._param_fqns()
        return None if named is None else {n for names in named.values() for n in names}

    def _group_fqns(self) -> list[list[str]] | None:
        named = self._param_fqns()
        if named is None or any(id(p) not in named for g in self.optimizer.param_groups for p in g["params"]):
            return None
        return [[n for p in g["params"] for n in named[id(p)]] for g in self.optimizer.param_groups]

    def _flat_names(self, skeleton: Any) -> Any:
        """A ``stateful.OptimizerAdapter`` for a checkpoint whose optimizer state is keyed by FSDP1's
        flat parameters (``0._flat_param``: written before these were saved by their parameters' names,
        with NO_SHARD or on one rank), which loads it as it was saved; None for any other."""
        if self.state is None or not any(n == "_flat_param" or n.endswith("._flat_param") for n in _saved_names(skeleton)):
            return None
        from .optnames import param_name_choices, param_name_map
        from .stateful import OptimizerAdapter

        adapter = OptimizerAdapter(self.optimizer, param_name_map(self.state))
        adapter.other_names, adapter.name_choices = param_name_map(self.state, other=True), param_name_choices(self.state)
        return adapter

    def load_state_dict(self, state_dict: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        self.check_saved(state_dict, None)  # loader._load checked it first; a direct caller gets it here
        if (flat := self._flat_names(state_dict)) is not None:
            flat.load_state_dict(state_dict)
            return
        fqn = self._fqn(state_dict)
        groups = [{**g, "params": [fqn(x) for x in g["params"]]} for g in state_dict["param_groups"]]
        params = {n for g in groups for n in g["params"]}
        state = {fqn(k): v for k, v in state_dict["state"].items()}
        saved_by_key = state_dict.get("state_by_key")  # no parameter's: set_optimizer_state_dict would drop it
        by_key = {**{k: v for k, v in state.items() if k not in params},  # saved in "state" by earlier versions
                  **(saved_by_key if isinstance(saved_by_key, dict) else {})}
        osd = {"state": {k: v for k, v in state.items() if k in params}, "param_groups": groups}
        set_optimizer_state_dict(self.model, self.optimizer, osd, options=_full_options())
        self.optimizer.state.update(by_key)


def _saved_names(skeleton: Any) -> list[str]:
    """The parameter names of a saved optimizer entry (its state's keys, its groups' params)."""
    if not isinstance(skeleton, dict):
        return []
    state, groups = skeleton.get("state"), skeleton.get("param_groups")
    names = [*(state if isinstance(state, dict) else ())]
    for g in groups if isinstance(groups, list) else ():
        names += g.get("params", []) if isinstance(g, dict) and isinstance(g.get("params"), list) else []
    return [n for n in names if type(n) is str]


def _full_options() -> Any:
    """Whole tensors on every rank, where they are (not rank 0's alone, which ``cpu_offload`` implies)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=False)
