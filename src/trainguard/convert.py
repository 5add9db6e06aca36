"""Import and export: trainguard checkpoints <-> ``torch.save`` files, safetensors files and
``torch.distributed.checkpoint`` (DCP) directories.

Offline, one process, no process group (called by ``trainguard convert`` or from Python).
Reading never unpickles anything from a trainguard checkpoint, a safetensors file or a
``torch.save`` file (``torch.load(weights_only=True)``). DCP is the exception: its
``.metadata`` file is a pickle that DCP's own reader loads, so a DCP directory must come from
a trusted source (a warning says so); its non-tensor entries are read with ``weights_only=True``
(``dcp_import``): JSON values are imported, other objects skipped.

Name mapping: a trainguard entry ``E`` with tensor ``E/name`` becomes ``name`` in a
safetensors/``.pt`` file (one entry, ``--entry``) and the DCP key ``E.name`` (every entry, or
only ``--entry``). Importing a DCP key gives back the nesting DCP recorded for it (``E.name``: entry ``E``, tensor ``name``); a
flat file becomes entry ``--entry`` (default ``model``), so ``{"model": module}`` loads it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from . import layout
from .commit import absent, read_manifest, run_dir_named
from .dcp_export import check_dcp_destination, write_dcp
from .errors import CheckpointError, StepExistsError
from .export import (
    check_destination,
    foreign_errors,
    local_file,
    no_tensors,
)
from .storage import for_path, location

FORMATS = ("trainguard", "torch", "safetensors", "dcp")
INDEX = ".index.json"
DCP_WARNING = (
    "reading a torch.distributed.checkpoint directory: its .metadata file is a pickle, and unpickling "
    "can run arbitrary code. Only convert DCP checkpoints from a trusted source"
)


def detect(path: str | os.PathLike[str]) -> str:
    """The format of an existing checkpoint at ``path``, by its shape on disk (``convert`` without ``src_format``,
    before anything is read or written). A path that is not there, or a run directory (``step-*`` directories,
    no manifest of its own), is refused saying so: before, both were told to pass ``--from``."""
    p = os.fspath(path)
    # Hugging Face shards' index (model.safetensors.index.json, pytorch_model.bin.index.json), or a file by its name
    if (by_name := target_format(p[: -len(INDEX)] if p.endswith(INDEX) else p)) != "trainguard":
        if "://" not in p and not os.path.lexists(p):  # a foreign file is local; "cannot read X as ...: FileNotFoundError" before
            raise CheckpointError(f"{p}: no such file or directory; check the path")
        return by_name
    storage, d = for_path(p)
    if storage.exists(storage.join(d, "manifest.json")):
        return "trainguard"
    if os.path.isfile(os.path.join(p, ".metadata")):
        return "dcp"
    if os.path.isdir(p) and (indexes := sorted(n for n in os.listdir(p) if n.endswith(INDEX))):
        raise CheckpointError(f"{p}: a sharded Hugging Face checkpoint? Convert its index: {os.path.join(p, indexes[0])}")
    if not storage.exists(d):  # a typo: "pass --from" sent the user after a format flag for a path that is not there
        raise CheckpointError(f"{p}: no such file or directory{absent(storage, d)}; check the path (a trainguard "
                              "checkpoint is a step directory of a run, `trainguard ls RUN_DIR` lists them)")
    if run_dir := run_dir_named(storage, d):  # as inspect/export/consolidate say it; "pass --from" was no way out
        raise CheckpointError(run_dir)
    if layout.parse_step(os.path.basename(d.rstrip("/"))) is not None:  # a save that crashed: "pass --from" misled
        read_manifest(storage, d)  # its NotACheckpointError: "not a committed checkpoint ... pick a valid step"
    raise CheckpointError(
        f"{p}: not a trainguard checkpoint (no manifest.json), DCP directory (no .metadata), "
        ".pt/.pth/.bin or .safetensors file (or *.index.json of their shards); pass the source format explicitly (--from)"
    )


def target_format(path: str | os.PathLike[str]) -> str:
    """The output format implied by a destination name (directories: trainguard)."""
    p = os.fspath(path)
    if p.endswith(".safetensors"):
        return "safetensors"
    if p.endswith((".pt", ".pth", ".bin")):
        return "torch"
    return "trainguard"


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    entry: str | None = "model",
    dcp_split: bool = True,
) -> dict[str, Any]:
    """Convert the checkpoint ``src`` into ``dst``; returns ``{"from", "to", "tensors", "skipped"}``.

    ``entry``: which trainguard entry to export (``None``: every entry; DCP output only), or
    which entry an imported flat file becomes. Importing DCP, ``dcp_split`` splits each key at
    its first dot into entry and name (a key without a dot is an entry of its own); without it
    every key goes into ``entry`` (a DCP of a bare ``model.state_dict()``). A foreign file that
    cannot be read or written raises ``CheckpointError``. One process, outside any process group
    (an import ends in :func:`trainguard.save`, a collective when torch.distributed is initialised).
    """
    if entry == "":  # it read as "model" on import (``entry or "model"``) and as a missing entry on export
        raise CheckpointError("entry '' names no entry: pass an entry's name (the default is model)")
    src, dst = local_file(src), local_file(dst)  # file:///x.safetensors as the local file, on either side
    sf = src_format or detect(src)
    df = dst_format or target_format(dst)
    for f in (sf, df):
        if f not in FORMATS:
            raise CheckpointError(f"unknown format {f!r}; use one of {', '.join(FORMATS)}")
    if (sf == "trainguard") == (df == "trainguard"):
        raise CheckpointError(f"convert {sf} -> {df}: " + (  # the same words for both said nothing to change
            f"{dst} names a trainguard directory too; name it .safetensors or .pt (or pass --to dcp), or copy a "
            "checkpoint with `trainguard consolidate SRC DST`" if sf == "trainguard" else
            "one side must be a trainguard checkpoint: convert into a trainguard directory first, then from it"))
    if sf == "trainguard":
        from .srcnamed import naming_source  # a corrupt source: named, with its earlier steps

        with naming_source(src):
            return _export_to(src, dst, df, entry)
    return _import(src, dst, sf, df, entry, dcp_split)


def _export_to(src: str, dst: str, df: str, entry: str | None) -> dict[str, Any]:
    """``convert`` from the trainguard checkpoint ``src`` to a ``df`` file or DCP directory ``dst``."""
    check_destination(os.fspath(dst))
    if df == "torch" and target_format(dst) == "safetensors":  # torch.load reads such a name as safetensors
        raise CheckpointError(f"{dst}: a torch.save file named .safetensors is refused by torch.load; name it .pt")
    if df == "safetensors" and target_format(dst) == "torch":  # torch.load, pytorch_model.bin's reader, refuses it
        raise CheckpointError(f"{dst}: a safetensors file named {os.path.splitext(os.fspath(dst))[1]} is refused by "
                              "torch.load; name it .safetensors, or drop --to safetensors for a torch.save file")
    if df == "dcp":
        check_dcp_destination(os.fspath(dst))
        from .dcp_lazy import read_entries

        state, n, source = read_entries(src, entry)
        with foreign_errors(f"cannot write {dst} as {df}"):
            write_dcp(state, os.fspath(dst), source)
        return {"from": "trainguard", "to": df, "tensors": n, "skipped": []}
    # streamed, as `export` writes them: one batch in memory, not the entry
    return {"from": "trainguard", "to": df, "tensors": _stream_file(src, dst, entry, df == "safetensors"), "skipped": []}


def _import(src: str, dst: str, sf: str, df: str, entry: str | None, dcp_split: bool) -> dict[str, Any]:
    """``convert`` of the foreign ``sf`` checkpoint ``src`` into the trainguard checkpoint ``dst``."""
    places: dict[Any, Any] | None = {} if sf == "dcp" else None  # DCP: placeholders, the tensors streamed (dcp_stream)
    with foreign_errors(f"cannot read {src} as {sf}"):
        state, skipped = _read_foreign(src, sf, "model" if entry is None else entry, dcp_split, places)
    # A flat file holding only the entry's own name is a one-tensor entry (an export of one).
    state = {k: v[k] if isinstance(v, Mapping) and list(v) == [k] else _unwrapped(v) for k, v in state.items()}
    if not _count(state):  # it wrote a checkpoint of no tensors and said "converted 0 tensors" (DCP's import refuses)
        found = ", ".join(_leaves(state)[:8]) or "nothing but empty containers"
        raise CheckpointError(f"{src}: the {sf} file holds no tensors (found: {found}); nothing written. Pass the file "
                              "that holds the weights (a state_dict of tensors)")
    from .api import save

    try:
        if places:  # empty: a DCP of stream transforms, read whole (_read_foreign)
            from .dcp_stream import save_dcp_import

            with foreign_errors(f"cannot read {src} as {sf}"):
                save_dcp_import(os.fspath(dst), state, places, os.fspath(src), places.pop("meta"))
        else:
            save(dst, _contiguous(state))  # torch.save keeps strides: transposed weights are common
    except StepExistsError:  # its "overwrite=True" is not an option of convert
        raise StepExistsError(
            f"{dst} already holds a committed checkpoint; convert does not replace one. Remove it or "
            "convert into a new directory"
        ) from None
    return {"from": sf, "to": df, "tensors": _count(state), "skipped": skipped}


WRAPPERS = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


def _unwrapped(v: Any) -> Any:
    """A state_dict saved from a wrapped model (every key ``module.*`` or ``_orig_mod.*``) without
    the prefix, as trainguard saves a wrapped module: it then loads into plain or wrapped models."""
    if not isinstance(v, Mapping) or not v or not (all(isinstance(t, torch.Tensor) for t in v.values())
                                                   or hasattr(v, "_metadata")):  # a module's, with extra state
        return v
    while True:
        prefix = next((p for p in WRAPPERS if all(isinstance(k, str) and k.startswith(p) for k in v)), None)
        if prefix is None or any(k == prefix for k in v):
            return v
        v = {k[len(prefix):]: t for k, t in v.items()}


def _leaves(v: Any, path: str = "") -> list[str]:
    """``path: type`` of each value in an imported state (``convert``'s refusal of one without tensors)."""
    items = v.items() if isinstance(v, Mapping) else enumerate(v) if isinstance(v, (list, tuple)) else None
    if items is None:
        return [f"{path or 'the value'}: {type(v).__name__}"]
    return [x for k, y in items for x in _leaves(y, f"{path}/{k}" if path else str(k))]


def _count(v: Any) -> int:
    """The number of tensors in an imported state."""
    if isinstance(v, torch.Tensor):
        return 1
    items = v.values() if isinstance(v, Mapping) else v if isinstance(v, (list, tuple)) else ()
    return sum(_count(x) for x in items)


def _stream_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], entry: str | None, safetensors: bool) -> int:
    """``convert`` of entry ``entry`` to a ``.safetensors`` (``safetensors``) or ``torch.save`` file, as
    ``export`` writes it (``export.write_file``: the tensors read in batches of up to 256 MiB, a
    larger tensor in pieces, and written in place; a tie is one tensor in a ``.pt`` file, a tensor
    per name in safetensors). Before session 51 the entry was read whole into memory and written by
    ``save_file`` or ``torch.save`` (a 1.5 GB entry: peak RSS 1.7 GB). Returns the number of tensors."""
    from .export import selected, write_file
    from .stwrite import refuse_names

    if entry is None:
        raise CheckpointError("exporting every entry needs a DCP destination (--to dcp); name one entry with --entry")
    storage, d = for_path(src)
    manifest = read_manifest(storage, d)
    if entry not in manifest.objects:
        raise CheckpointError(f"{location(storage, d)} has no entry {entry!r}; it has {sorted(manifest.objects)}. Pass --entry NAME")
    mine = selected(manifest, entry)
    if not mine:
        raise CheckpointError(no_tensors(manifest, location(storage, d), entry))
    out = os.fspath(dst)
    if os.path.isdir(out):  # as export says it; the error named the temporary file beside it ("Is a directory")
        raise CheckpointError(f"{out} is a directory; pass a file name ending in .safetensors or .pt (or --to dcp "
                              "for a DCP directory)")
    if safetensors:
        refuse_names((n for n, _p, _e in mine), out)
    write_file(storage, d, manifest, entry, out, safetensors=safetensors)
    return len(mine)


def _contiguous(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if v.is_nested or v.layout is not torch.strided or v.is_quantized or v.is_meta:
            return v  # the save refuses it, naming it and what to save instead
        return v.resolve_conj().resolve_neg().contiguous()
    if isinstance(v, Mapping):
        return {k: _contiguous(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_contiguous(x) for x in v)
    return v


def _legacy_unreadable(p: str, e: Exception) -> bool:
    """``_read_foreign``: ``torch.load`` of a legacy (non-zip) file failed in torch's own storage code, not
    for an unsafe global: a float8/uint16-64/complex32 tensor of that format ("type object
    'torch.storage.UntypedStorage' has no attribute 'dtype'"), which ``weights_only=False`` fails alike."""
    import zipfile

    return isinstance(e, AttributeError) and "UntypedStorage" in str(e) and not zipfile.is_zipfile(p)


def _read_foreign(src: str | os.PathLike[str], fmt: str, entry: str, dcp_split: bool = True,
                  places: dict[Any, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    p = os.fspath(src)
    if p.endswith(INDEX) and fmt in ("safetensors", "torch"):
        return {entry: _read_shards(p, fmt)}, []
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return {entry: load_file(p)}, []
    if fmt == "torch":
        try:
            obj = _torch_load(p)
        except OSError as e:  # missing, a directory, no permission: not a refusal to unpickle (as safetensors says it)
            raise CheckpointError(f"cannot read {p} as a torch.save file: {type(e).__name__}: {e.strerror or e}") from e
        except Exception as e:
            if _legacy_unreadable(p, e):  # weights_only=False fails the same: no advice to unpickle
                raise CheckpointError(
                    f"{p} is in torch's legacy format (torch.save(..., _use_new_zipfile_serialization=False)), which "
                    f"this torch cannot read back for some dtypes (float8, uint16-64, complex32: {e}), with or without "
                    "weights_only. Save those tensors again from the process that has them, in the default format") from e
            why = next((ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln), "")
            why = why.split(" was not an allowed global")[0].replace("WeightsUnpickler error: ", "") or str(e)
            # A whole pickled object (torch.save(model)): ['model'] of it fails; its state_dict() is the advice.
            get = ".state_dict()" if _pickled_object(p) else "['model']"
            raise CheckpointError(
                f"{p}: torch.load(weights_only=True) refused it ({why}). trainguard does not unpickle arbitrary "
                "objects; if you trust the file, re-save what you need as tensors and plain containers, e.g. "
                f"torch.save(torch.load({os.path.basename(p)!r}, weights_only=False){get}, 'weights.pt')"
            ) from e
        if isinstance(obj, torch.Tensor):  # torch.save(tensor): an entry that is one tensor, as it loads into
            return {entry: obj}, []   # {"model": tensor} and exports back (before: a dict {"tensor": ...})
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{p}: holds a {type(obj).__name__}; convert needs a dict (a state_dict)")
        if all(isinstance(v, torch.Tensor) for v in obj.values()) or _one_state_dict(obj):
            return {entry: obj if hasattr(obj, "_metadata") else dict(obj)}, []  # a plain state_dict (_unwrapped)
        if all(isinstance(k, str) and k and "/" not in k and "@" not in k for k in obj):
            return dict(obj), []  # {"model": ..., "optim": ...}: one entry each
        return {entry: dict(obj)}, []
    from .dcp_import import read_dcp

    warnings.warn(DCP_WARNING, stacklevel=3)
    if places is not None:  # streamed (dcp_stream), unless its items went through stream transforms
        import torch.distributed.checkpoint as dcp

        from .dcp_stream import transformed

        places["meta"] = meta = dcp.FileSystemReader(p).read_metadata()
        if transformed(meta):  # compressed: read by dcp.load, whole, as before session 51 (places emptied: no streaming)
            places.clear()
            return read_dcp(p, entry, dcp_split)
    return read_dcp(p, entry, dcp_split, places)


def _pickled_object(p: str) -> bool:
    """Whether the ``torch.save`` file ``p`` holds one object of a class at its top level (``torch.save(model)``),
    not a container: its pickle's first opcode after the protocol (and a class's name) is a class (read, never
    executed); an empty dict, a list, ... first: False."""
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(p) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            with z.open(name) as f:
                for _i, (op, _arg, _pos) in zip(range(8), pickletools.genops(f)):  # protocol 2: GLOBAL; 4: two
                    if op.name not in ("PROTO", "FRAME", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE", "BINPUT"):
                        return op.name in ("GLOBAL", "STACK_GLOBAL")  # strings, then STACK_GLOBAL
    except Exception:  # not a zip, no data.pkl, a damaged pickle: the generic advice
        return False
    return False


def _one_state_dict(obj: Mapping[Any, Any]) -> bool:
    """``_read_foreign``: whether a ``torch.save`` file's dict is one state_dict, imported as one entry,
    though not all its values are tensors: a module's (its ``_metadata``, which ``torch.load`` gives
    back: a model with extra state, as ``export`` to ``.pt`` writes it) or an optimizer's
    (a dict ``state`` and a list ``param_groups``, with trainguard's ``class`` in an export). Before,
    each of its keys became an entry of its own (``0.weight``, ``0._extra_state``, ...; ``state``
    and ``param_groups``), which ``{"model": module}`` or ``{"optim": optimizer}`` does not load."""
    return hasattr(obj, "_metadata") or isinstance(obj.get("state"), Mapping) and isinstance(obj.get("param_groups"), list)


def _torch_load(p: str) -> Any:
    """``torch.load(weights_only=True)`` of a file to import, memory-mapped (``mmap=True``): the
    tensors are the file's pages, as safetensors' ``load_file`` gives them, read as the save
    writes them; without it the whole file was copied into memory first and held until the
    import's save ended (a 256 MiB file: 256 MiB more anonymous memory). The legacy (pre-zip)
    format cannot be mapped: it is read whole, as before."""
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "_use_new_zipfile_serialization" not in str(e):
            raise
    return torch.load(p, map_location="cpu", weights_only=True)


def _read_shards(index: str, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face sharded checkpoint: ``index`` (``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json``) maps each name to its shard file, beside it; each shard is
    read once, and every name the index lists must be in its shard."""
    import json

    with open(index, "rb") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no \"weight_map\" of tensor names to shard files; is it a Hugging Face index?")
    head = os.path.dirname(index)
    out: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard {shard!r} is not a file name beside the index")
        names = [k for k, v in weight_map.items() if v == shard]
        tensors = _read_foreign(os.path.join(head, shard), fmt, "model")[0]["model"]
        if not isinstance(tensors, Mapping) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise CheckpointError(f"{index}: shard {shard} is not a flat dict of tensors")
        if missing := [n for n in names if n not in tensors]:
            raise CheckpointError(f"{index}: {len(missing)} tensor(s) the index places in {shard} are not in it: {missing[:5]}")
        out.update((n, tensors[n]) for n in names)
    return out
