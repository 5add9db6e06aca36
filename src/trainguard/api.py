"""``save`` and ``load``: the collective entry points.

Every rank calls ``save(path, state)`` with the same path and the same entry names; the
phases are::

    capture (sync, each rank)  ->  round "begin" (agree on step, entries, save id)
    write own chunks + fsync   ->  round "written" (every rank reports chunks or its traceback)
    rank 0: manifest.json LAST, rename temp dir  ->  broadcast "commit" outcome

``load(path, state)`` is called by every rank too; each reads only the byte ranges that
overlap what it holds, and the outcome is exchanged so all ranks succeed or all raise.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__, layout
from .commit import read_manifest
from .dist import DistContext, ensure_optimizer_state, failure, is_dtensor, shard_of, summary
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    RankFailureError,
    StateMismatchError,
    StepExistsError,
    UnsupportedValueError,
)
from .faults import fault
from .flatten import flatten, tensor_refs, unflatten
from .handle import SaveHandle
from .io import DEFAULT_BLOCK, ReadTarget, WriteChunk, read_targets, tensor_bytes, write_file
from .manifest import DTYPE_NAMES, Chunk, Manifest, TensorEntry
from .planner import Box, ReplicatedItem, assign_replicated, full_box, layout_file, overlapping, plan_reads
from .stateful import ModuleAdapter, OptimizerAdapter, adapt, has_state, is_rank_local, param_name_map
from .storage import Storage, for_path


@dataclass
class Leaf:
    """One tensor of the captured state, as this rank holds it."""

    path: str
    tensor: torch.Tensor  # local data (the shard for a DTensor)
    dtype: str
    shape: tuple[int, ...]  # global shape
    box: Box  # the local box in global coordinates
    kind: str  # "replicated" | "sharded" | "local" | "full"
    writer: bool = True


@dataclass
class Snapshot:
    """What ``capture`` took from the live state: JSON skeletons (copied now) and tensor refs."""

    objects: dict[str, Any]
    rank_local: list[str]
    leaves: list[Leaf]
    entry_sig: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def _check_key(key: Any) -> str:
    if type(key) is not str or not key or "/" in key or "@" in key or key.startswith("$"):
        raise UnsupportedValueError(
            f"state key {key!r}: top-level keys must be non-empty strings without '/' or '@'"
        )
    return key


def capture(state: Mapping[str, Any], *, ctx: DistContext, layout_kind: str = "sharded") -> Snapshot:
    """Take the state apart into JSON skeletons and tensor leaves (every rank, synchronously).

    Tensors are referenced, not copied; async saving copies them in its stage phase.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"state must be a dict of entries, got {type(state).__name__}")
    names = param_name_map(state)
    objects: dict[str, Any] = {}
    rank_local: list[str] = []
    leaves: list[Leaf] = []
    for key, value in state.items():
        _check_key(key)
        obj = adapt(value, names)
        sd = obj.state_dict() if has_state(obj) else obj
        local = is_rank_local(value)
        if local:
            rank_local.append(key)
        skel, tensors = flatten(sd, f"{key}@{ctx.rank}" if local else key)
        objects[key] = skel
        for path, t in tensors.items():
            leaves.append(_leaf(path, t, local, layout_kind, ctx.rank))
    sig = hashlib.sha1(
        json.dumps(
            [sorted(state), sorted(rank_local), sorted((lf.path, lf.shape, lf.dtype) for lf in leaves if lf.kind != "local")]
        ).encode()
    ).hexdigest()
    return Snapshot(objects=objects, rank_local=rank_local, leaves=leaves, entry_sig=sig)


def _leaf(path: str, t: torch.Tensor, local: bool, layout_kind: str, rank: int = 0) -> Leaf:
    full = layout_kind == "full" and not local
    if is_dtensor(t) and full:
        t = t.full_tensor()  # collective on the training group: every rank reaches it in the same order
    data, shape, offsets, writer = shard_of(t)
    if data.dtype not in DTYPE_NAMES:
        raise UnsupportedValueError(f"{path}: dtype {data.dtype} is not supported; convert the tensor")
    if not data.is_contiguous():
        raise UnsupportedValueError(
            f"{path}: tensor is not contiguous (strides {tuple(data.stride())}); call .contiguous() on it "
            "before saving, or return a contiguous copy from state_dict()"
        )
    kind = "local" if local else ("sharded" if is_dtensor(t) else "replicated")
    if full:
        # layout="full": whole tensors, one chunk each, all in rank 0's file (export/inference).
        kind, writer = "full", rank == 0
        if rank != 0:
            data = data.new_empty((0,) * data.dim())  # others only need shape and dtype
    box = full_box(shape) if full else Box(tuple(offsets), tuple(data.shape))
    return Leaf(path, data.detach(), DTYPE_NAMES[data.dtype], shape, box, kind, writer)


def my_chunks(snap: Snapshot, ctx: DistContext, base_loads: list[int]) -> list[tuple[Leaf, Box]]:
    """The chunks this rank writes: its shards, its rank-local tensors, and its balanced share
    of the replicated tensors (the same deterministic assignment on every rank)."""
    by_path = {lf.path: lf for lf in snap.leaves}
    rep = sorted((lf for lf in snap.leaves if lf.kind == "replicated"), key=lambda lf: lf.path)
    items = [ReplicatedItem(lf.path, lf.shape, lf.tensor.element_size()) for lf in rep]
    mine = [(by_path[p], b) for p, b, r in assign_replicated(items, ctx.world_size, base_loads) if r == ctx.rank]
    mine += [(lf, lf.box) for lf in snap.leaves if lf.kind != "replicated" and lf.writer]
    return mine


def chunk_view(leaf: Leaf, box: Box) -> torch.Tensor:
    """The contiguous CPU-side tensor holding ``box`` of ``leaf`` (a row range or the whole)."""
    t = leaf.tensor
    if box != leaf.box:  # a dim-0 row range of a replicated tensor
        t = t[box.offsets[0] : box.offsets[0] + box.sizes[0]]
    return t


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    async_: bool = False,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    max_staging_bytes: int | None = None,
) -> Any:
    """Save ``state`` into the checkpoint directory ``path`` (every rank calls it).

    Returns the committed :class:`Manifest` (on every rank), or with ``async_=True`` a
    ``SaveHandle`` whose ``result()`` gives it. Raises ``StepExistsError`` when ``path`` is
    already a checkpoint (``overwrite=True`` replaces it), ``UnsupportedValueError`` for a
    leaf that is neither a tensor nor JSON, ``RankFailureError`` when any rank failed.
    """
    if layout not in ("sharded", "full"):
        raise ValueError(f"layout={layout!r}: use 'sharded' (each rank writes its part) or 'full'")
    storage, target = for_path(path)
    handle = start_save(
        storage, target, state, DistContext.current(),
        async_=async_, layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout,
        max_staging_bytes=max_staging_bytes,
    )
    return handle if async_ else handle.result()


def start_save(
    storage: Storage,
    target: str,
    state: Mapping[str, Any],
    ctx: DistContext,
    *,
    async_: bool = False,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    step: int | None = None,
    max_staging_bytes: int | None = None,
) -> SaveHandle:
    """Start a save on every rank; sync saves return an already completed handle.
    ``max_staging_bytes`` caps the async path's host staging memory (docs/async.md)."""
    if async_:
        from .async_save import start_async_save

        # Its own channel: the background commit's collectives may interleave with the training
        # thread's (the manager's "decide") in a different order on each rank.
        return start_async_save(
            storage, target, state, ctx.channel("async-save"), layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout,
            step=step, max_staging_bytes=max_staging_bytes,
        )
    snap = _collective_capture(state, ctx, layout, timeout)
    manifest = persist_and_commit(
        storage, target, snap, ctx, layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout, step=step
    )
    return SaveHandle.completed(manifest, manifest.step)


def _collective_capture(state: Mapping[str, Any], ctx: DistContext, layout_kind: str, timeout: float | None) -> Snapshot:
    try:
        return capture(state, ctx=ctx, layout_kind=layout_kind)
    except Exception as e:
        # Tell the other ranks before raising, so they fail now instead of at the timeout.
        if ctx.is_distributed:
            # Every rank, this one included, raises the same RankFailureError.
            begin = ctx.all_gather("begin", {"error": traceback.format_exc()}, timeout=timeout)
            _raise_failures("save", begin, ctx)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"could not capture the state: {e}") from e


def _raise_failures(what: str, outcomes: list[Any], ctx: DistContext) -> None:
    failures = {r: o["error"] for r, o in enumerate(outcomes) if o.get("error")}
    if not failures:
        return
    if not ctx.is_distributed and len(failures) == 1:
        raise CheckpointError(f"{what} failed:\n{failures[0]}")
    raise failure(f"{what} failed on rank(s) {sorted(failures)}", failures)


def persist_and_commit(
    storage: Storage,
    target: str,
    snap: Snapshot,
    ctx: DistContext,
    *,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    stage: Any = None,
    step: int | None = None,
) -> Manifest:
    """Phases 2 and 3 of a save, on every rank: write own chunks, exchange outcomes, commit.

    ``stage(leaf, box)`` may supply the bytes of a chunk (the async path's host copies);
    by default they come from the tensors themselves. Safe to run on a background thread:
    it only talks to other ranks through the store.
    """
    parent, name = os.path.split(target.rstrip("/"))
    own = sum(lf.tensor.nbytes for lf in snap.leaves if lf.kind != "replicated" and lf.writer)
    if step is None:
        step = layout_mod.parse_step(name) or 0
    hello: dict[str, Any] = {"sig": snap.entry_sig, "step": step, "own": own, "error": None}
    if ctx.rank == 0:
        hello["id"] = uuid.uuid4().hex[:16]
        final = storage.join(parent, name)
        if storage.exists(storage.join(final, layout_mod.MANIFEST)) and not overwrite:
            hello["exists"] = f"{final} already holds a committed checkpoint; pass overwrite=True to replace it"
    begin = ctx.all_gather("begin", hello, timeout=timeout)
    _check_begin(begin, ctx)
    save_id = begin[0]["id"]
    work = storage.join(parent, layout_mod.tmp_dir(name, save_id) if storage.atomic_rename else name)
    fault("begin", ctx.rank)
    report: dict[str, Any] = {"error": None}
    try:
        storage.makedirs(work)
        report = _write_rank(storage, work, snap, ctx, [b["own"] for b in begin], stage)
        fault("written", ctx.rank)
    except Exception as e:
        report = {"error": _describe(e)}
    # Only rank 0 receives the chunk lists (a gather, not an all_gather: O(world) store traffic).
    outcome: dict[str, Any] = {"error": None}
    manifest = None
    try:
        written = ctx.gather("written", report, timeout=timeout)
    except RankFailureError as e:  # rank 0 only: a rank died or never reported
        written, outcome = None, {"error": summary(e), "failures": e.failures}
    if ctx.rank == 0 and written is not None:
        try:
            _raise_failures("save", written, ctx)
            manifest = _build_manifest(snap, written, ctx, layout, metadata, step)
            fault("before_manifest", ctx.rank)
            # Invariant: the manifest is written only after every rank reported its data durable.
            _commit(storage, parent, name, work, manifest, overwrite, save_id)
        except RankFailureError as e:
            outcome = {"error": summary(e), "failures": e.failures}
        except Exception as e:
            outcome = {"error": _describe(e)}
    if ctx.rank == 0 and outcome.get("error"):
        storage.remove_tree(work)
    outcome = ctx.broadcast("commit", outcome, timeout=timeout)
    if outcome.get("failures"):
        raise failure(outcome["error"], {int(r): tb for r, tb in outcome["failures"].items()})
    if outcome.get("error"):
        raise CheckpointError(f"save of {target} failed at commit on rank 0:\n{outcome['error']}")
    if manifest is None:
        manifest = read_manifest(storage, storage.join(parent, name))
    return manifest


layout_mod = layout  # the module, shadowed by the ``layout`` keyword in this file


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointError):
        return f"{type(e).__name__}: {e}"
    return traceback.format_exc()


def _check_begin(begin: list[Any], ctx: DistContext) -> None:
    _raise_failures("save", begin, ctx)
    if begin[0].get("exists"):
        raise StepExistsError(begin[0]["exists"])
    steps = {r: b["step"] for r, b in enumerate(begin)}
    off = [r for r, s in steps.items() if s != steps[0]]
    if off:
        raise RankFailureError(
            f"save: ranks disagree on the step: {steps}; every rank must save the same step",
            {r: f"called save with step {steps[r]}, rank 0 with {steps[0]}" for r in off},
        )
    sigs = {r: b["sig"] for r, b in enumerate(begin)}
    bad = [r for r, s in sigs.items() if s != sigs[0]]
    if bad:
        raise RankFailureError(
            f"save: rank(s) {bad} passed a different set of entries/tensors than rank 0; every rank must "
            "save the same state keys with the same tensor names, shapes and dtypes",
            {r: "state differs from rank 0's" for r in bad},
        )


def _write_rank(
    storage: Storage, work: str, snap: Snapshot, ctx: DistContext, base_loads: list[int], stage: Any
) -> dict[str, Any]:
    mine = my_chunks(snap, ctx, base_loads)
    views = [stage(lf, b) if stage else chunk_view(lf, b) for lf, b in mine]
    cpu = [v if isinstance(v, memoryview) else tensor_bytes(v if v.is_cpu else v.cpu()) for v in views]
    offsets, size = layout_file([len(v) for v in cpu])
    fname = layout_mod.data_file(ctx.rank)
    sums = write_file(
        storage,
        storage.join(work, fname),
        [WriteChunk(v, o) for v, o in zip(cpu, offsets)],
        size,
        block=DEFAULT_BLOCK,
        fault=lambda p: fault(p, ctx.rank),
    )
    chunks = [
        [lf.path, lf.dtype, list(lf.shape), list(b.offsets), list(b.sizes), o, len(v), s]
        for (lf, b), v, o, s in zip(mine, cpu, offsets, sums)
    ]
    local_objects = {k: snap.objects[k] for k in snap.rank_local}
    return {"error": None, "file": fname, "size": size, "chunks": chunks, "objects": local_objects}


def _build_manifest(
    snap: Snapshot, written: list[Any], ctx: DistContext, layout: str, metadata: Mapping[str, Any] | None, step: int
) -> Manifest:
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    for w in written:
        if w["chunks"] or w["size"]:
            files[w["file"]] = w["size"]
        for path, dtype, shape, offs, sizes, off, length, sums in w["chunks"]:
            e = tensors.setdefault(path, TensorEntry(dtype, shape, []))
            e.chunks.append(Chunk(offs, sizes, w["file"], off, length, sums))
    for lf in snap.leaves:  # zero-size tensors have no chunks but must exist
        if lf.kind != "local":
            tensors.setdefault(lf.path, TensorEntry(lf.dtype, list(lf.shape), []))
    for w in written:
        for path, dtype, shape, *_ in w["chunks"]:
            tensors.setdefault(path, TensorEntry(dtype, shape, []))
    for e in tensors.values():
        e.chunks.sort(key=lambda c: (c.offsets, c.file))
    objects: dict[str, Any] = {}
    for key, skel in snap.objects.items():
        if key in snap.rank_local:
            objects[key] = {"ranks": [w["objects"][key] for w in written]}
        else:
            objects[key] = {"skeleton": skel}
    return Manifest(
        step=step or 0,
        world_size=ctx.world_size,
        created=time.time(),
        layout=layout,
        block_size=DEFAULT_BLOCK,
        files=files,
        objects=objects,
        tensors=dict(sorted(tensors.items())),
        metadata=dict(metadata or {}),
        library=f"trainguard {__version__}",
        torch_version=torch.__version__,
    )


def _commit(storage: Storage, parent: str, name: str, work: str, manifest: Manifest, overwrite: bool, save_id: str) -> None:
    # Invariant: we get here only after every rank reported its data durable (fsynced).
    storage.write_atomic(storage.join(work, layout_mod.MANIFEST), manifest.to_bytes())
    fault("after_manifest", 0)
    final = storage.join(parent, name)
    if not storage.atomic_rename:
        return  # object stores: the manifest written last *is* the commit marker
    storage.fsync_dir(work)
    if storage.exists(final):
        if not overwrite and storage.exists(storage.join(final, layout_mod.MANIFEST)):
            raise StepExistsError(f"{final} was committed by someone else during this save")
        old = storage.join(parent, layout_mod.old_dir(name, save_id))
        storage.rename_dir(final, old)
        storage.rename_dir(work, final)
        storage.remove_tree(old)
    else:
        storage.rename_dir(work, final)
    fault("after_rename", 0)


# ----------------------------------------------------------------------------- load


@dataclass
class _Dest:
    path: str
    tensor: torch.Tensor | None  # the live destination (None: allocate)
    key: str


def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | dict[str, Any],
    *,
    strict: bool = True,
    only: Iterable[str] | None = None,
    verify: bool = True,
    timeout: float | None = None,
) -> Manifest:
    """Load the checkpoint at ``path`` into ``state`` in place (every rank calls it).

    Bytes are read straight into the destination tensors' memory. With ``strict``, missing,
    unexpected and mismatched entries raise one ``StateMismatchError`` listing all of them.
    ``only=["model"]`` loads a subset of the entries. Checksums of every byte read are
    verified unless ``verify=False``. All ranks succeed or all raise.
    """
    ctx = DistContext.current()
    storage, target = for_path(path)
    try:
        manifest = read_manifest(storage, target)
        _load(storage, target, manifest, state, ctx, strict, only, verify)
        err = None
    except Exception as e:
        if not ctx.is_distributed:
            raise
        err, exc = _describe(e), e
    if ctx.is_distributed:
        outcomes = ctx.all_gather("load", {"error": err}, timeout=timeout)
        if err is not None:
            raise exc
        _raise_failures(f"load of {target}", outcomes, ctx)
    return manifest


def _load(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    state: Mapping[str, Any],
    ctx: DistContext,
    strict: bool,
    only: Iterable[str] | None,
    verify: bool,
) -> None:
    keys = list(state) if only is None else list(only)
    unknown = [k for k in keys if k not in state]
    if unknown:
        raise StateMismatchError(missing=[f"{k} (in only=, not in state)" for k in unknown], unexpected=[], mismatched=[])
    missing_keys = [k for k in keys if k not in manifest.objects]
    unexpected_keys = [k for k in manifest.objects if k not in state] if only is None else []
    names = param_name_map(state)
    plans = []  # (key, adapter, skeleton, {path: dest tensor})
    missing: list[str] = list(missing_keys)
    unexpected: list[str] = list(unexpected_keys)
    mismatched: list[str] = []
    for key in keys:
        if key in missing_keys:
            continue
        value = state[key]
        obj = adapt(value, names)
        if isinstance(obj, OptimizerAdapter):
            # A fresh optimizer of DTensor params has no state to read shards into: create it.
            ensure_optimizer_state(obj.optimizer)
        skel, src_rank = _skeleton_for(manifest, key, value, ctx)
        if skel is None:
            continue
        prefix = f"{key}@{src_rank}" if src_rank is not None else key
        cur = obj.state_dict() if has_state(obj) else value
        _, dest = flatten(cur, prefix)
        refs = tensor_refs(skel)
        for p in refs:
            if p not in manifest.tensors:
                raise CorruptCheckpointError(f"manifest references tensor {p!r} that it does not describe", entry=p)
        # Modules have a fixed set of tensors: report every difference. Optimizers: shapes must
        # match (a fresh one has no state yet). Other objects: their load_state_dict decides; a
        # tensor whose shape changed is simply read into a new tensor.
        if isinstance(obj, ModuleAdapter):
            missing += [p for p in dest if p not in refs]
            unexpected += [p for p in refs if p not in dest]
        for p in refs:
            d = dest.get(p)
            if d is not None:
                e = manifest.tensors[p]
                if list(d.shape) != e.shape or DTYPE_NAMES.get(d.dtype) != e.dtype:
                    if isinstance(obj, (ModuleAdapter, OptimizerAdapter)):
                        mismatched.append(f"{p} (checkpoint {e.dtype}{e.shape}, state {str(d.dtype)[6:]}{list(d.shape)})")
                    else:
                        del dest[p]
        plans.append((key, obj, skel, dest))
    if strict and (missing or unexpected or mismatched):
        raise StateMismatchError(missing=missing, unexpected=unexpected, mismatched=mismatched)
    bad = {m.split(" ")[0] for m in mismatched}
    # Sizes on disk are checked before any destination is allocated: a manifest cannot make
    # this rank allocate more than the files it points at really hold.
    wanted = {c.file for _k, _o, skel, _d in plans for p in tensor_refs(skel) if p not in bad for c in manifest.tensors[p].chunks}
    _check_file_sizes(storage, directory, manifest, wanted)
    targets: list[ReadTarget] = []
    finish: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging cpu tensor, live destination)
    loaded: dict[str, torch.Tensor] = {}
    for _key, _obj, skel, dest in plans:
        for p in tensor_refs(skel):
            if p in bad:
                continue
            e = manifest.tensors[p]
            live = dest.get(p)
            t, box, stage_back = _destination(live, e)
            loaded[p] = live if live is not None else t
            if stage_back is not None:
                finish.append((t, stage_back))
            near = [e.chunks[i] for i in overlapping([(c.offsets, c.sizes) for c in e.chunks], box)]
            ops = plan_reads(
                [(Box(tuple(c.offsets), tuple(c.sizes)), c.file, c.offset, c.length, c.checksums) for c in near],
                box,
                e.torch_dtype.itemsize,
                manifest.block_size,
                verify,
            )
            targets.append(ReadTarget(p, t, box, ops))
    _check_files(storage, directory, manifest, targets)
    read_targets(storage, directory, targets)
    for staged, live in finish:
        live.copy_(staged)
    for key, obj, skel, dest in plans:
        value = unflatten(skel, lambda p, dest=dest: loaded.get(p, dest.get(p)))
        try:
            if isinstance(obj, ModuleAdapter):
                obj.load_state_dict(value, strict=strict)
            elif has_state(obj):
                obj.load_state_dict(value)
            elif isinstance(state, dict):
                state[key] = value
        except CheckpointError:
            raise
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"entry {key!r}: its load_state_dict() refused the saved state: {e}. The object must be built "
                "the same way as when it was saved (same parameter groups, same configuration)"
            ) from e


def _skeleton_for(manifest: Manifest, key: str, value: Any, ctx: DistContext) -> tuple[Any, int | None]:
    """This rank's skeleton for entry ``key`` (rank-local entries: the rule in docs/distributed.md)."""
    obj = manifest.objects[key]
    if "skeleton" in obj:
        return obj["skeleton"], None
    ranks = obj["ranks"]
    if ctx.rank < len(ranks):
        if len(ranks) != ctx.world_size:
            import warnings

            warnings.warn(
                f"{key}: saved by {len(ranks)} ranks, loading on {ctx.world_size}; rank {ctx.rank} takes saved "
                f"rank {ctx.rank}'s state",
                stacklevel=4,
            )
        return ranks[ctx.rank], ctx.rank
    import warnings

    if hasattr(value, "reseed_for_rank"):
        value.reseed_for_rank(ctx.rank)
        warnings.warn(f"{key}: no saved state for rank {ctx.rank} (saved by {len(ranks)} ranks); re-seeded", stacklevel=4)
        return None, None
    src = ctx.rank % len(ranks)
    warnings.warn(f"{key}: no saved state for rank {ctx.rank}; taking saved rank {src}'s", stacklevel=4)
    return ranks[src], src


def _destination(live: torch.Tensor | None, e: TensorEntry) -> tuple[torch.Tensor, Box, torch.Tensor | None]:
    """(tensor to read into, its box, live tensor to copy into afterwards or None)."""
    if live is None:
        t = torch.empty(e.shape, dtype=e.torch_dtype)
        return t, full_box(e.shape), None
    data, shape, offsets, _ = shard_of(live)
    box = Box(tuple(offsets), tuple(data.shape))
    if data.is_cpu and data.is_contiguous():
        return data, box, None
    return torch.empty(tuple(data.shape), dtype=data.dtype), box, data


def _check_files(storage: Storage, directory: str, manifest: Manifest, targets: list[ReadTarget]) -> None:
    _check_file_sizes(storage, directory, manifest, {op.file for t in targets for op in t.ops})


def _check_file_sizes(storage: Storage, directory: str, manifest: Manifest, needed: set[str]) -> None:
    for f in sorted(needed):
        p = storage.join(directory, f)
        if not storage.exists(p):
            raise CorruptCheckpointError(f"{p}: data file is missing", file=f)
        actual = storage.size(p)
        if actual != manifest.files[f]:
            raise CorruptCheckpointError(
                f"{p}: {actual} bytes on disk, the manifest says {manifest.files[f]} (truncated or replaced)", file=f
            )
