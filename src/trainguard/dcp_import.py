"""Read a ``torch.distributed.checkpoint`` (DCP) directory whole, for ``convert`` (one process,
no process group; the caller warns that DCP's ``.metadata`` is a pickle).

DCP flattens a nested state into dotted keys and records, in its metadata's ``planner_data``,
the path each key came from: ``optim.state.0.weight.exp_avg`` is
``("optim", "state", "0.weight", "exp_avg")``. :func:`read_dcp` rebuilds that nesting, so an
optimizer written from ``get_state_dict`` comes back as ``{"state": {name: {...}},
"param_groups": [...]}``, which loads into ``{"optim": optimizer}`` (a plain
``optimizer.state_dict()``, keyed by index, too: DCP wrote its keys as strings). DCP's non-tensor entries
(each one ``torch.save``-d) are read with ``torch.load(weights_only=True)``; those that are
JSON values (an optimizer's ``lr``, ``betas``, ``params``; a step counter) are imported, any
other object is skipped and listed.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .errors import CheckpointError


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """``convert``'s ``dcp.save`` (``dcp_export.write_dcp``) and ``dcp.load`` (:func:`read_dcp`), which pass
    ``no_dist=True`` (one process by design): without torch's warning that it assumes one process
    ("torch.distributed is disabled, unavailable or uninitialized, ..."), printed to the user as a
    ``warning:`` line on every DCP conversion, about nothing to change. Other warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


def read_dcp(path: str, entry: str, split: bool = True, places: dict[int, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``(state, skipped)`` of the DCP directory ``path``. ``split``: each key's first path
    element is its entry (keys that cannot name one go into ``entry``); without it, every key
    goes into ``entry``, nested as DCP recorded it (a DCP of a bare ``model.state_dict()``: its
    keys as they are, JSON values such as a module's extra state included). ``places`` (``convert``'s
    streamed import, ``dcp_stream``): the tensors are not read; each is a ``meta`` tensor of its
    shape and dtype, and ``places[id(t)]`` is ``(its DCP key, t)``; the non-tensor values are read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from .dcp_empty import empty_dicts

    meta = dcp.FileSystemReader(path).read_metadata()
    flat: dict[str, Any] = {}
    skipped: list[str] = []
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta" if places is not None else "cpu")
            if places is not None:
                places[id(flat[fqn])] = (fqn, flat[fqn])
        elif isinstance(md, BytesStorageMetadata):  # unsplit too: a bare state_dict's extra state
            flat[fqn] = io.BytesIO()
        else:
            skipped.append(fqn)
    if not flat:
        raise CheckpointError(f"{path}: the DCP checkpoint holds no tensors")
    values: dict[str, Any] = {}

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # DCP's own: weights_only=False
            fqn = read_item.dest_index.fqn
            try:
                values[fqn] = _detached(torch.load(value, map_location="cpu", weights_only=True))
            except Exception:
                values[fqn] = _Refused

    wanted = flat if places is None else {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    if wanted:
        with single_process():  # no_dist: torch's "assuming ... a single process" warning is no news here
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(path), planner=Planner(flatten_state_dict=False), no_dist=True)
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    dims = {k: len(md.size) if isinstance(md, TensorStorageMetadata) else -1 for k, md in meta.state_dict_metadata.items()}
    model_keys = _titan_model_keys(paths, dims) if split else set()
    state: dict[str, Any] = {}

    def place(fqn: str, keys: Any, v: Any) -> None:  # the value of DCP key ``fqn`` at its place in ``state``
        if not split:  # every key in ``entry``, nested as DCP recorded it: a bare state_dict's keys as they are,
            # a module's extra state {"n": 7} (DCP: "0._extra_state.n") "0._extra_state" again, as it loads
            whole = keys if isinstance(keys, tuple) and keys and type(keys[0]) is str else (fqn,)
            _put(state.setdefault(entry, {}), whole, v, fqn, path)
            return
        if not isinstance(keys, tuple) or len(keys) < 2 or type(keys[0]) is not str:
            keys = tuple(fqn.split(".", 1))  # a flat key (a bare state_dict's): split at its first dot
        head = keys[0]
        if fqn in model_keys or not head or "/" in head or "@" in head or head.startswith("$"):
            state.setdefault(entry, {})[fqn] = v
        elif len(keys) == 1:
            if head in state:
                raise CheckpointError(f"{path}: key {fqn!r} is a value and holds other keys ({fqn}.*) too")
            state[head] = v  # a key without a dot: an entry that is one tensor (or value)
        else:
            node = state.setdefault(head, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"{path}: key {fqn!r} lies inside {head!r}, which is a value itself")
            _put(node, keys[1:], v, fqn, path)

    for fqn, v in flat.items():
        if not isinstance(v, torch.Tensor):
            v = values.get(fqn, _Refused)
            if _has_dtensor(v):  # pickled whole (flatten_state_dict=False): one rank's shards, the rest not saved
                raise CheckpointError(
                    f"{path}: DCP key {fqn!r} is a value pickled whole that holds DTensors (a DCP saved with "
                    "DefaultSavePlanner(flatten_state_dict=False)): DCP kept one rank's copy of it, with that rank's "
                    "shards only, so the full tensors are not in the checkpoint. Save it again with DCP's default "
                    "planner (flatten_state_dict=True), which writes every rank's shards as DCP tensors")
            if v is _Refused or not _plain(v):
                skipped.append(fqn)  # a pickled object (bytes, a class): not imported
                continue
        place(fqn, paths.get(fqn), v)
    for fqn, keys in empty_dicts(meta, paths):  # recorded by trainguard's export (dcp_empty.py): DCP writes no item
        place(fqn, keys, {})
    if not any(_has_tensor(v) for v in state.values()):  # only pickled values, none of them holding a tensor
        raise CheckpointError(
            f"{path}: the DCP checkpoint holds no tensors"
            + (f" that trainguard can read (pickled values skipped: {', '.join(skipped[:5])})" if skipped else "")
        )
    return {k: _unflat_optimizer(v) if _is_flat_optimizer(v) else _lists(v, k) for k, v in state.items()}, skipped


def _has_tensor(v: Any) -> bool:
    """Whether ``v`` is a tensor or a (nested) dict/list/tuple holding one: a DCP saved with
    ``DefaultSavePlanner(flatten_state_dict=False)`` pickles each top-level value whole, its
    tensors inside."""
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_has_tensor(x) for x in v)


def _detached(v: Any) -> Any:
    """``Planner.load_bytes``: a pickled value with its ``nn.Parameter``s as plain tensors (a
    ``state_dict(keep_vars=True)`` saved unflattened; before, the whole value was skipped as no plain
    value). Only the containers ``_plain`` accepts are walked."""
    if type(v) is torch.nn.Parameter:
        return v.detach()
    if type(v) in (list, tuple):
        return type(v)(_detached(x) for x in v)
    if type(v) is dict:
        return {k: _detached(x) for k, x in v.items()}
    return v


def _has_dtensor(v: Any) -> bool:
    """Whether the pickled value ``v`` is or holds (in dicts, lists, tuples) a ``DTensor``."""
    if isinstance(v, torch.Tensor):
        return type(v).__name__ == "DTensor" and type(v).__module__.startswith("torch.distributed")
    if isinstance(v, dict):
        return any(_has_dtensor(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_has_dtensor(x) for x in v)


_FLAT_OPTIM = ("state.", "param_groups.")


def _is_flat_optimizer(v: Any) -> bool:
    """An optimizer entry that ``get_optimizer_state_dict(..., StateDictOptions(
    flatten_optimizer_state_dict=True))`` flattened (torchtitan saves it so): keys
    ``state.<param fqn>.<name>`` and ``param_groups.<param fqn>.<name>`` only."""
    return (
        isinstance(v, dict) and bool(v) and all(type(k) is str and k.startswith(_FLAT_OPTIM) and "." in k[6:] for k in v)
        and any(k.startswith("param_groups.") for k in v)
    )


def _unflat_optimizer(v: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer (:func:`_is_flat_optimizer`) in the form trainguard saves and loads:
    ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``. The flat form
    keeps each parameter's group values, not the groups: parameters with the same values are
    one group (as torch's own unflattening matches them to the optimizer's groups)."""
    state: dict[str, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for k, x in v.items():
        kind, rest = k.split(".", 1)
        fqn, name = rest.rsplit(".", 1)
        (state if kind == "state" else per_param).setdefault(fqn, {})[name] = x
    groups: dict[str, dict[str, Any]] = {}
    for fqn, values in per_param.items():
        g = groups.setdefault(repr(sorted(values.items())), {**values, "params": []})
        g["params"].append(fqn)
    return {"state": state, "param_groups": [_lists(g, "") for g in groups.values()], BY_VALUES: True}


BY_VALUES = "param_groups_by_values"  # marks an optimizer entry whose groups are its parameters' values


def regroup(saved_groups: list[Any], names: list[str], sizes: list[int]) -> list[Any]:
    """``OptimizerAdapter`` (``check_saved``, ``load_state_dict``), for an optimizer entry marked
    ``BY_VALUES`` (:func:`_unflat_optimizer`): the flat form keeps each parameter's group values,
    not its groups, so two groups with equal values (decay and no-decay groups before their
    ``weight_decay`` differs) were imported as one. The saved groups made the optimizer's, as
    torch's ``set_optimizer_state_dict`` matches a flat state: each current group (``sizes``: their
    lengths, ``names``: their parameters in order, spelt as in the checkpoint) takes the values of
    the saved group that holds its parameters. A current group whose parameters were saved with
    different values is refused; other parameters than the checkpoint's: returned as is, for
    ``_match_groups`` to name the differences."""
    where = {n: i for i, g in enumerate(saved_groups) for n in g["params"]}
    if set(where) != set(names) or len(names) != sum(sizes) or 0 in sizes:
        return saved_groups
    out, pos = [], 0
    for gi, size in enumerate(sizes):
        cur, pos = names[pos : pos + size], pos + size
        found = sorted({where[n] for n in cur})
        if len(found) > 1:
            from .permanent import mark

            a, b = (next(n for n in cur if where[n] == i) for i in found[:2])
            raise mark(CheckpointError(
                f"parameter group {gi} holds parameters saved with different group values ({a!r}: "
                f"{_values(saved_groups[found[0]])}, {b!r}: {_values(saved_groups[found[1]])}); build the "
                "optimizer with the same groups as when it was saved"
            ))
        out.append({**saved_groups[found[0]], "params": cur})
    return out


def saved_groups(adapter: Any, saved: Any, warn: bool) -> Any:
    """``OptimizerAdapter``: the ``param_groups`` of the saved optimizer entry ``saved`` (a
    skeleton or the state read), those of an entry marked ``BY_VALUES`` made ``adapter``'s
    optimizer's by :func:`regroup`."""
    from collections.abc import Mapping

    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(saved, Mapping) or saved.get(BY_VALUES) is not True or not isinstance(groups, list):
        return groups
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return groups
    names = adapter._saved_names(adapter._index_names(warn), {n for g in groups for n in g["params"]})
    return regroup(groups, names, [len(g["params"]) for g in adapter.optimizer.param_groups])


def _values(group: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in group.items() if k not in ("params", "param_names"))[:300]


def _titan_model_keys(paths: dict[str, Any], dims: dict[str, int]) -> set[str]:
    """The model keys of a torchtitan checkpoint, which saves the model's state_dict at the top
    level (``layers.0.attention.wq.weight``, DCP records it flat) beside ``optimizer``,
    ``lr_scheduler``, ``dataloader``, ``train_state``: these go into one entry (``--entry``,
    default ``model``) instead of an entry per first name. Recognised by the flattened optimizer
    beside them, whose parameter names are all among those top-level keys; else empty. A top-level
    key with no dot that names no parameter and is no tensor of one or more dimensions (``dims``:
    each key's, -1 for a non-tensor) is no model key: ``step`` or ``loss_scale`` saved beside the
    model stays an entry of its own, as without a flattened optimizer; torchtitan's persistent
    ``freqs_cis`` buffer is the model's."""
    top = {fqn for fqn, keys in paths.items() if isinstance(keys, tuple) and len(keys) == 1}
    params = {
        keys[1].split(".", 1)[1].rsplit(".", 1)[0]
        for keys in paths.values()
        if isinstance(keys, tuple) and len(keys) == 2 and type(keys[1]) is str
        and keys[1].startswith(_FLAT_OPTIM) and "." in keys[1][6:]
    }
    return {k for k in top if "." in k or k in params or dims.get(k, -1) > 0} if params and params <= top else set()


_SCALARS = (int, float, bool, str, type(None))


class _Refused:
    """A non-tensor DCP entry that ``torch.load(weights_only=True)`` refused."""


def _plain(v: Any) -> bool:
    """Whether ``v`` is a JSON value trainguard saves (an object of another type is skipped), or a dense
    tensor inside one: DCP flattens lists, not tuples, so a tuple of tensors (which trainguard's own
    export to DCP writes so) comes as one pickled value."""
    if v is None or type(v) in (bool, int, float, str):
        return True
    if type(v) is torch.Tensor:
        return v.layout is torch.strided and not (v.is_quantized or v.is_meta or v.is_nested)
    if type(v) in (list, tuple):
        return all(_plain(x) for x in v)
    if type(v) is dict:
        return all(type(k) in (str, int) and _plain(x) for k, x in v.items())
    return False


def _put(node: dict[Any, Any], keys: tuple[Any, ...], v: Any, fqn: str, path: str) -> None:
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise CheckpointError(f"{path}: key {fqn!r} lies inside {k!r}, which is a value itself")
    if keys[-1] in node:
        raise CheckpointError(f"{path}: key {fqn!r} is a value and holds other keys ({fqn}.*) too")
    node[keys[-1]] = v


def _lists(v: Any, key: Any) -> Any:
    """DCP writes a list's items under their int index (``param_groups.0.lr``) and a dict's keys
    as strings: a level whose keys are exactly ``0..n-1`` becomes a list again, as DCP's own
    loader makes it; a dict whose keys are all digits over plain values (a ``MultiStepLR``'s
    ``milestones``) gets int keys, else its schedule would never match an epoch; an optimizer's
    state keyed by parameter index (``optimizer.state_dict()``, whose ``params`` are ints) gets
    its int keys back, else nothing would match its parameters; an optimizer without state yet
    (DCP wrote no key for an empty dict) gets ``state: {}``."""
    if not isinstance(v, dict):
        return v
    out = {k: _lists(x, k) for k, x in v.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    if out and all(_int_key(k) and type(x) in _SCALARS for k, x in out.items()):
        return {int(k): x for k, x in out.items()}  # a MultiStepLR's milestones {30: 1}: int keys again
    groups = out.get("param_groups")
    if isinstance(groups, list) and groups and all(isinstance(g, dict) and "params" in g for g in groups):
        out.setdefault("state", {})  # an optimizer without state yet (SGD, no momentum): DCP wrote no key for it
    state = out.get("state")
    if (
        isinstance(groups, list) and isinstance(state, dict)
        and all(isinstance(g, dict) and all(type(i) is int for i in g.get("params", ())) for g in groups)
        and all(_int_key(k) for k in state)
    ):
        out["state"] = {int(k): x for k, x in state.items()}
    return out


def _int_key(k: Any) -> bool:
    """Whether ``k`` is an int key that DCP wrote as a string: ASCII digits, written as ``str(int)``
    writes them ("07" or a superscript digit is a string key of its own, kept)."""
    return type(k) is str and k.isascii() and k.isdigit() and str(int(k)) == k
