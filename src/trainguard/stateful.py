"""What can be saved: the ``Stateful`` protocol, plain progress values, RNG state (rngstate.py), the adapters
that turn modules and optimizers into name-keyed state dicts (DDP comm hooks' states: commhooks.py).

``api.save``/``api.load`` call :func:`adapt` once per top-level entry of the user's state, on
every rank, before flattening. Nothing here knows about files or torch.distributed.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from . import wrapnames
from .commhooks import POWER_SGD, HookStateAdapter, hook_kind
from .errors import UnsupportedValueError
from .flatten import refill
from .names import canonical_key, canonical_names, is_torch_wrapper, saved_metadata
from .rngstate import RNGState

__all__ = ["Stateful", "StateDict", "RNGState", "adapt", "unwrap_module", "is_rank_local"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()`` can be an entry of the state."""

    def state_dict(self) -> dict[str, Any]:
        """Called by every save on every rank; tensors are saved by rank, JSON values as rank 0's
        (each rank's own when the object sets ``trainguard_rank_local = True``)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by ``load``/``restore`` on every rank, after the saved bytes were read and verified."""
        ...


class StateDict(dict):
    """A dict of plain progress values (step, tokens, epoch...) that loads in place.

    ``state["progress"] = tg.StateDict(step=0, tokens=0)``; after ``restore``, the same object
    holds the saved values. Values are tensors or JSON values, like every leaf.
    """

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        refill(self, dict(state_dict))  # its nested dicts and lists in place too (flatten.refill)


def check_state(state: Any) -> None:
    """``save``/``load``/``restore``: the state must be a mapping of entry names to objects."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            f"state must be a dict of named entries, e.g. {{'model': model, 'optim': optimizer}}; got {type(state).__name__}"
        )
    for key, value in state.items():  # a class where its object was meant: its state_dict() misses self
        if isinstance(value, type) and callable(getattr(value, "state_dict", None)):
            raise UnsupportedValueError(f"{key}: the state holds the class {value.__qualname__}, not an object of it; "
                                        f"pass the object (e.g. state[{key!r}] = {value.__qualname__}(...))")


def is_rank_local(obj: Any) -> bool:
    """True for entries each rank saves separately (RNG, per-rank iterators, PowerSGD's error feedback)."""
    return bool(getattr(obj, "trainguard_rank_local", False)) or hook_kind(obj) == POWER_SGD


def unwrap_module(module: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = module.module
        elif is_torch_wrapper(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


_EXTRA = re.compile(r"[/.]_extra_state(/|$)")


class ModuleAdapter:
    """Saves an ``nn.Module`` under wrapper-free names; loads into wrapped or unwrapped models."""

    def __init__(self, module: nn.Module) -> None:
        self.module = unwrap_module(module)
        self.metadata: Any = None  # the last state_dict()'s _metadata: capture's names.module_versions

    def state_dict(self) -> dict[str, Any]:
        sd = self.module.state_dict()
        self.metadata = getattr(sd, "_metadata", None)
        return dict(zip(canonical_names(self.module, list(sd)), sd.values(), strict=True))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, versions: Any = None) -> None:
        """``loader._load`` (every rank), with the values read from the checkpoint. A ``_metadata``
        (each submodule's ``_version``) goes with them, as in the ``state_dict()`` that
        ``torch.save`` keeps: without it a versioned ``_load_from_state_dict`` takes the values for
        a pre-version checkpoint and "upgrades" them (a quantization observer reset its ``eps`` to
        float32's, so its scale changed on resume). ``versions``: the entry's recorded versions
        (``names.saved_metadata``; None: the module's own)."""
        current = self.module.state_dict()
        keys = list(current)
        actual = dict(zip(canonical_names(self.module, keys), keys, strict=True))
        state_dict = wrapnames.to_module(state_dict, actual)  # see unwrapped_names
        mapped = {actual.get(k, k): v for k, v in state_dict.items()}
        for name, names in self.tied().items():  # one name of a tie loads the others
            if name in actual and actual[name] not in mapped:
                have = next((actual[n] for n in names if n in actual and actual[n] in mapped), None)
                if have is not None:
                    mapped[actual[name]] = mapped[have]
        ordered = OrderedDict(mapped)
        metadata = saved_metadata(self.module, getattr(current, "_metadata", None), versions, mapped)
        if metadata is not None:
            ordered._metadata = metadata  # type: ignore[attr-defined]
        self.module.load_state_dict(ordered, strict=strict)

    def tied(self) -> dict[str, list[str]]:
        """Every name of a parameter or buffer the module holds under several names (a tie:
        ``lm_head.weight`` IS ``wte.weight``) -> all its names. ``loader._load`` does not report
        a tied name missing when another of its names is in the checkpoint (safetensors keeps one)."""
        groups: dict[int, list[str]] = {}
        for n, t in [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]:
            groups.setdefault(id(t), []).append(canonical_key(n))
        return {n: names for names in groups.values() if len(names) > 1 for n in names}

    @staticmethod
    def unwrapped_names(refs: list[str], dest: dict[str, Any], head: str) -> dict[str, Any]:
        """``loader._load``: ``dest`` (path -> the state's tensor) keyed by the checkpoint's paths
        ``refs`` when those are exactly the module's own without their leading ``module.``, else
        ``dest``. ``convert`` drops the ``module.`` of a torch file saved from a DDP model; a model
        whose child is named ``module`` (an EMA wrapper) saved so then loads again, and
        ``load_state_dict`` puts the prefix back."""
        return wrapnames.keyed(refs, dest, head)  # and a plain dict saved from a DDP / compiled model's state_dict()

    @staticmethod
    def extra_state_paths(paths: Iterable[str], prefix: str) -> set[str]:
        """``loader._load``: the tensor paths of module entry ``prefix`` that lie in a module's extra
        state (``get_extra_state()``; TransformerEngine's FP8 metadata is a uint8 tensor whose size
        changes). Torch hands that value to ``set_extra_state`` as it is, checking no shape: these
        are read into new tensors, and reported neither missing nor unexpected."""
        return {p for p in paths if "_extra_state" in p and _EXTRA.search(p, len(prefix))}

    @staticmethod
    def extra_state_diff(skel: Any, current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """``loader._load`` (every rank, before anything is read): the extra-state keys
        (``<submodule>._extra_state``, from ``get_extra_state()``) of the module's ``current``
        state dict that the saved skeleton ``skel`` lacks, and those it holds that the module has
        no more. Torch's strict ``load_state_dict`` refuses both, but only after the load had read
        every tensor into the state; a value without tensors was not seen before it at all."""
        if type(skel) is not dict:
            return [], []
        have = [k for k in current if _EXTRA.search("/" + k)]
        saved = [k for k in skel if type(k) is str and _EXTRA.search("/" + k)]
        m = wrapnames.own_names(list(skel), current) or {}  # imported without DDP's "module.", or saved with it
        taken = {m.get(k, k) for k in saved}
        return [k for k in have if k not in taken], [k for k in saved if m.get(k, k) not in current]

    def param_names(self) -> dict[int, str]:
        """``id(param) -> name``; a tie by its first name, under which ``capture`` writes the tensor (optnames.py)."""
        return {pid: names[0] for pid, names in self.param_all_names().items()}

    def param_all_names(self) -> dict[int, list[str]]:
        """``id(param) -> its names`` in the module's order (several for a tie)."""
        from .walks import named_parameters

        named = named_parameters(self.module)  # the save call's one walk of the module (walks.py)
        out: dict[int, list[str]] = {}
        for (_, p), c in zip(named, canonical_names(self.module, [n for n, _ in named]), strict=True):
            out.setdefault(id(p), []).append(c)
        return out


# Keys OptimizerAdapter writes itself (dcp_import.BY_VALUES: imported groups); others of state_dict() are kept.
_OWN_KEYS = frozenset({"state", "param_groups", "class", "param_groups_by_values", "state_by_key"})


class OptimizerAdapter:
    """Optimizer state keyed by parameter *name* instead of integer index.

    ``names`` maps ``id(param)`` to its name (from the modules in the same state); parameters
    not found there are named ``param.<index>`` (with a warning at save time).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
        self.optimizer = optimizer
        self.names = names
        self.other_names: Mapping[int, str] = {}  # param_name_map(other=True), set by loader._load
        self.name_choices: Mapping[int, list[str]] = {}  # param_name_choices(state), set by loader._load
        self._warned = False  # one adapter per save or load: its warning once, not at each call

    def _saved_names(self, names: list[str], saved: set[str]) -> list[str]:
        """``names``, or their other spelling (``other_names``) when the checkpoint's are those:
        saved from a state with one module, loaded into one with several, or back; or, for each
        parameter, the one of its names (``name_choices``) that the checkpoint holds: a module
        entry that is part of another (``{"model": m, "head": m[1]}``) listed in another order."""
        if set(names) == saved:
            return names
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for other in ([self.other_names.get(id(p)) for p in params],
                      [c[0] if len(c := [n for n in self.name_choices.get(id(p), ()) if n in saved]) == 1 else None
                       for p in params]):
            if None not in other and len(set(other)) == len(other) and set(other) == saved:
                return other  # type: ignore[return-value]
        return names

    def _index_names(self, warn: bool = True) -> list[str]:
        out: list[str] = []
        unnamed = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = self.names.get(id(p))
                if name is None:
                    unnamed += 1
                    name = f"param.{len(out)}"
                out.append(name)
        if unnamed and warn and not self._warned:
            self._warned = True
            warnings.warn(
                f"{unnamed} optimizer parameter(s) belong to no nn.Module in the saved state; they are "
                "keyed by index, which breaks if parameters are re-ordered. Save the model in the same state (to save "
                "some parameters only, a frozen model's adapters: an nn.ParameterDict of them as the entry, docs/checkpoints.md).",
                stacklevel=3,
            )
        if len(set(out)) != len(out):
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            if len({id(p) for p in params}) != len(params):
                raise ValueError("optimizer holds the same parameter twice; trainguard keys optimizer state by name")
            dup = sorted({n for n in out if out.count(n) > 1})
            raise ValueError(
                f"two different optimizer parameters get the same name {dup[:4]}: trainguard keys optimizer state by "
                "name (the module's, prefixed by its entry's key when the state holds several modules; "
                "'param.<index>' for one in no module of the state). Rename the entry or the module's attribute "
                "(an entry key with a '.' can spell another's child), or put that parameter in a module of the state")
        return out

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        names = self._index_names()
        # torch keys a parameter's state by its index and keeps any other key of optimizer.state as it is (an
        # optimizer's own counter, self.state["global_step"]): those go under "state_by_key", which no parameter
        # name can collide with; before, names[key] raised TypeError and the optimizer could not be saved.
        by_key = {k: s for k, s in sd["state"].items() if type(k) is not int}
        return {  # with a wrapper's own top-level values (PostLocalSGDOptimizer's averager "step"), as torch.save keeps them
            **{k: v for k, v in sd.items() if k not in _OWN_KEYS},
            "state": {names[i]: s for i, s in sd["state"].items() if type(i) is int},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
            "class": optimizer_class(self.optimizer),
            **({"state_by_key": by_key} if by_key else {}),
        }

    def check_saved(self, skeleton: Any, key: str, manifest: Any = None) -> None:
        """``loader._load``, before anything is read into the state (a refused load left the model
        and the optimizer's moments loaded, the rest not): refuse the state of another optimizer
        class (Adam's into SGD loaded, then failed at the first ``step()``; into RAdam it trained
        on) and other parameter groups. The class is not checked for checkpoints from before it
        was saved; the groups of torch's own form (by index) by their sizes only (``optim_groups.index_groups``).
        ``manifest``: the checkpoint's, for what a refusal says (``optim_groups.ties``, ``optim_groups.worlds``)."""
        from .dcp_import import saved_groups
        from .errors import CheckpointError
        from .optim_groups import index_groups, refuse_other_class
        from .permanent import mark  # each refusal: the same at every restart

        self._manifest = manifest
        refuse_other_class(self.optimizer, skeleton, f"entry {key!r}: ")
        try:
            groups = saved_groups(self, skeleton, warn=False)  # an imported flat optimizer's: regrouped
            if isinstance(groups, list) and all(
                isinstance(g, dict) and isinstance(g.get("params"), list) and all(type(n) is str for n in g["params"])
                for g in groups
            ):
                self._match_groups(groups, warn=False)  # load_state_dict warns
            elif isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                  and all(type(i) is int for i in g["params"]) for g in groups):
                if why := index_groups(groups, self.optimizer.param_groups):  # torch's form: by position
                    raise CheckpointError(why)
        except CheckpointError as e:
            raise mark(CheckpointError(f"entry {key!r}: {e}")) from None

    def _match_groups(self, saved_groups: list[Any], warn: bool = True) -> list[list[str]]:
        """The names of each current group's parameters, spelt as in the checkpoint; raises
        ``CheckpointError`` when the groups differ from the saved ones (their count, or which
        parameters each holds)."""
        from .errors import CheckpointError
        from .optim_groups import count_mismatch, other_params, ties, unowned_hint, worlds
        from .permanent import mark
        from .rankload import split_hint

        names = self._saved_names(self._index_names(warn), {n for g in saved_groups for n in g["params"]})
        cur_groups = self.optimizer.param_groups
        saved_names = [n for g in saved_groups for n in g["params"]]
        if not self.names and not any(n.startswith("param.") for n in saved_names):  # {"optim": o}: no module names them
            raise mark(CheckpointError(
                f"the state holds no module to name this optimizer's parameters: trainguard keys optimizer state by "
                f"parameter name, taken from the modules of the same state, and the checkpoint names them "
                f"{saved_names[:6]}; put the model in the state too (state = {{'model': model, 'optim': optim}}; "
                "only=['optim'] then loads the optimizer alone)"))
        if len(saved_groups) != len(cur_groups):  # which groups differ, and add_param_group's part in it
            raise mark(CheckpointError(count_mismatch(saved_groups, names, cur_groups)))
        out, pos = [], 0
        for cur in cur_groups:
            out.append(names[pos : pos + len(cur["params"])])
            pos += len(cur["params"])
        for gi, (saved, cur_names, cur) in enumerate(zip(saved_groups, out, cur_groups)):
            if set(saved["params"]) != set(cur_names):  # renamed, added or removed, regrouped (optim_groups.py)
                part = set(cur_names) < set(saved["params"]) and not set(saved_names) <= set(names)  # a pipeline stage's
                # optimizer, loaded without split_state (not a parameter moved to another group: every one is here)
                raise mark(CheckpointError(
                    other_params(gi, saved_groups, out, ties(self))
                    + (split_hint(*worlds(self), sentence=False) if part else "")
                    + unowned_hint(cur["params"], self.names)
                ))
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Called by ``loader._load``, which puts the entry's name in front of a refusal."""
        from .dcp_import import saved_groups as regrouped
        from .optim_hparams import warn_overridden
        from .optload import keep_scalar_dtypes
        saved_groups = regrouped(self, state_dict, warn=False) or state_dict["param_groups"]  # _match_groups warns
        if all(type(i) is int for g in saved_groups for i in g["params"]):
            # torch's own form, keyed by index (a torch.save file imported by ``convert``): matched by position.
            warn_overridden(self.optimizer.param_groups, saved_groups)
            self.optimizer.load_state_dict(dict(state_dict))
            return keep_scalar_dtypes(self.optimizer, saved_groups, state_dict["state"])
        per_group = self._match_groups(saved_groups)
        warn_overridden(self.optimizer.param_groups, saved_groups)  # before torch replaces the script's values
        index = {n: i for i, n in enumerate(n for names in per_group for n in names)}
        groups = []
        for saved, cur_names, cur in zip(saved_groups, per_group, self.optimizer.param_groups, strict=True):
            # torch matches saved to current parameters by position: give the current order, and
            # (torch takes the saved "param_names" over the current ones) the current group's own
            # names (checkpoint_wrapper turned on or off since the save names them otherwise), else
            # the saved ones in the same order (an optimizer built from named_parameters()).
            ids = [index[n] for n in cur_names]
            group = {**saved, "params": _Ids(ids) if len(ids) > 16 else ids}  # a short list scans faster
            given, own = saved.get("param_names"), cur.get("param_names")
            if isinstance(own, list) and len(own) == len(cur["params"]):
                group["param_names"] = list(own)
            elif isinstance(given, list) and len(given) == len(saved["params"]):
                by_name = dict(zip(saved["params"], given, strict=True))
                group["param_names"] = [by_name[n] for n in cur_names]
            groups.append(group)
        by_id = {index[n]: s for n, s in state_dict["state"].items() if n in index}
        by_key = state_dict.get("state_by_key")  # torch's load keeps a key that is no parameter's id as it is
        self.optimizer.load_state_dict({
            **{k: v for k, v in state_dict.items() if k not in _OWN_KEYS},  # a wrapper's own values
            "state": {**by_id, **by_key} if isinstance(by_key, Mapping) else by_id, "param_groups": groups,
        })
        keep_scalar_dtypes(self.optimizer, groups, by_id)  # NAdam's mu_product: not cast to the parameters' dtype


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The class name saved with an optimizer's state (``OptimizerAdapter``); a wrapper that keeps
    the real optimizer in ``.optimizer`` (Accelerate's) names the one it wraps."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return type(optimizer).__qualname__


class _Ids(list):
    """A group's parameter ids as ``OptimizerAdapter.load_state_dict`` hands them to torch, whose
    ``Optimizer.load_state_dict`` asks for every state tensor which group holds its id
    (``param_id in group["params"]``): a list scans, O(params**2) for one large group (Adam over
    16,000 parameters: 4.7 s; 100,000: minutes); this answers from a set. torch keeps only the
    list's length and items (the live group keeps its own ``params``)."""

    def __init__(self, ids: Iterable[int]) -> None:
        super().__init__(ids)
        self._set = frozenset(self)

    def __contains__(self, x: object) -> bool:
        return x in self._set


def adapt(value: Any, names: Mapping[int, str]) -> Any:
    """The object whose ``state_dict()``/``load_state_dict()`` trainguard calls for one entry,
    or the value itself when it is plain data (a tensor or JSON)."""
    if isinstance(value, nn.Module):
        return ModuleAdapter(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerAdapter(value, names)
    return HookStateAdapter(value) if hook_kind(value) else value  # a DDP comm hook's state (PowerSGD)


def has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
