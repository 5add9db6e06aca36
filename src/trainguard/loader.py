"""``load``: every rank reads the manifest, plans the byte ranges overlapping what it holds
(resharding when the world size changed), reads them straight into the destination tensors,
verifies checksums, then calls each entry's ``load_state_dict``. The outcome is exchanged, so
all ranks succeed or all raise the same error."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin

from . import gaps, optload, prechecks, rankload, resizable, scalerstate, split
from .aliases import shared_destinations
from .buffers import castable, holds, in_place, may_overlap
from .commit import check_file_sizes, read_manifest
from .dist import DistContext, check_timeout, one_operation
from .dtensor import is_dtensor, local_part, shard_of
from .dtypes import DTYPE_NAMES
from .errors import CheckpointError, CorruptCheckpointError, agree_load, unreadable
from .flatten import flatten, keep_types, refill, same_values, single_tensor, tensor_refs, unflatten
from .fsdp1 import FSDP1OptimizerAdapter, refuse_unsupported
from .gcpause import gc_paused
from .index import ChunkSource, plan_args
from .io import ReadTarget, read_targets
from .loadfiles import check_needed
from .manifest import Manifest, TensorEntry
from .names import alias_saved_paths, canonical_optimizer
from .optnames import param_name_choices, param_name_map
from .partread import in_checkpoint, in_place_entries, loaded_round, partly_read
from .permanent import check_flags, mark_refusal
from .planner import Box, full_box, plan_reads, whole_read
from .schedclass import check_entries
from .stateful import ModuleAdapter, OptimizerAdapter, adapt, check_state, has_state
from .storage import Storage, for_path, location
from .userframe import user_stacklevel


@one_operation
def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | dict[str, Any],
    *,
    strict: bool = True,
    only: Iterable[str] | None = None,
    verify: bool = True,
    timeout: float | None = None,
    split_state: bool = False,
) -> Manifest:
    """Load the checkpoint at ``path`` into ``state`` in place (every rank calls it).

    Bytes are read straight into the destination tensors' memory. With ``strict``, missing,
    unexpected and mismatched entries raise one ``StateMismatchError`` listing all of them.
    ``only=["model"]`` loads a subset of the entries. Checksums of every byte read are
    verified unless ``verify=False``. All ranks succeed or all raise. An async save in flight
    first finishes copying the state it saves (``async_save.wait_staging_in_flight``).
    ``split_state=True``: each rank takes only the tensors its state holds (pipeline stages: ``split.py``).
    Returns the checkpoint's manifest, with what this rank's load left alone (``rankload.record_keys``):
    ``missing_keys``, ``unexpected_keys``, ``mismatched_keys`` (empty after a strict load).
    """
    check_timeout(timeout)
    check_flags(strict=strict, verify=verify, split_state=split_state)  # strict="no" is truthy: a strict load
    if only is not None and not isinstance(only, (str, bytes)):
        only = list(only)  # a generator: the plan round and _load both read it
    ctx = DistContext.current()
    storage, target = for_path(path)
    shown = location(storage, target)  # in errors: s3://bucket/run/step-N, not bucket/run/step-N
    from .async_save import wait_staging_in_flight  # here: async_save imports api, which imports this

    wait_staging_in_flight()  # an async save still copying the state would save what this loads
    agreed: list[bool] = []  # [False] once this rank joined the first round ("load"), [True] once every rank passed it
    manifest: Manifest | None = None
    wrote: list[Any] = []  # partread.py: [False] once every rank passed the plan round, then each entry this rank wrote into

    def plan_round(e: Exception | None = None, taken: set[str] | None = None) -> None:  # _load's, before it writes
        agreed.append(False)
        which = None if manifest is None else [manifest.step, manifest.created]  # ranks that read another one: all raise
        agree_load(ctx, "load", shown, e, timeout, split=split_state, which=which,  # ... as ranks that differ in split_state
                   only=None if only is None or set(only) == set(state) else sorted({str(k) for k in only}))
        agreed[0] = True
        if taken is not None:  # split_state: every tensor of the checkpoint goes to some rank
            split.check_taken(ctx, manifest, taken, timeout)

    try:
        with gc_paused():
            manifest = read_manifest(storage, target)
            _load(storage, target, manifest, state, ctx, strict, only, verify, plan_round, split_state, wrote)
    except Exception as exc:
        exc = in_checkpoint(unreadable(exc, shown), shown, manifest)  # rebound: no cycle holds _load's tensors
        if not ctx.is_distributed:
            raise partly_read(exc, wrote) from exc.__cause__
        if not agreed:  # refused before its reads were planned: the other ranks wait in the plan round
            plan_round(partly_read(exc, ()))  # raises it (or the ranks' disagreement): no rank read anything
        if not agreed[0]:  # the plan round raised, on every rank
            raise partly_read(exc, ()) from exc.__cause__
        loaded_round(ctx, shown, exc, timeout, wrote)  # past the plan round: marked with the entries any rank wrote into
    if ctx.is_distributed:
        loaded_round(ctx, shown, None, timeout)
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
    plan_round: Any,
    split_state: bool,
    wrote: list[Any],
) -> None:
    check_state(state)
    if isinstance(only, (str, bytes)):
        raise TypeError(f"only={only!r}: pass a list of entry names, e.g. only=[{only!r}]")
    keys = list(state) if only is None else list(only)
    if only is not None and not keys:  # an `only=[k for k in state if ...]` that matched nothing: a no-op that looked done
        raise CheckpointError("only=[] names no entry, so nothing would be loaded: pass the entries' names, or only=None for all")
    unknown = [k for k in keys if k not in state]
    if unknown:
        raise CheckpointError(
            f"only= names entries that are not in the state: {unknown}; the state has {sorted(state)[:20]}"
        )
    missing_keys = [k for k in keys if k not in manifest.objects]
    unexpected_keys = [k for k in manifest.objects if k not in state] if only is None and not split_state else []
    names, other_names, choices = param_name_map(state), {}, {}
    plans = []  # (key, adapter, skeleton, {path: dest tensor}, tensor paths of the skeleton)
    missing: list[str] = list(missing_keys)
    unexpected: list[str] = list(unexpected_keys)
    mismatched: list[str] = []
    bad: dict[str, str] = {}  # path -> its line of ``mismatched``: not read (strict=False keeps its values)
    skip = set(missing_keys)
    current: dict[str, Any] = {}  # key -> the destination's own state_dict() (or value), for keep_types
    later: list[Any] = []  # rankload: re-seeding a rank the checkpoint has no state for, once loaded
    for key in keys:
        if key in skip:
            continue
        value = state[key]
        skel = manifest.objects[key].get("skeleton")
        if type(value) is torch.Tensor and single_tensor(skel) == key:
            # An entry that is one plain tensor (a flat dict of tensors: thousands of them),
            # saved as such: what the general path below does, without its per-entry calls.
            # The manifest's validation checked that the tensor is described.
            e = manifest.tensors[key]
            if (value.is_nested or list(value.shape) != e.shape or DTYPE_NAMES.get(value.dtype) != e.dtype
                    or value.is_meta or value.layout is not torch.strided or _expanded(value)
                    or value.nbytes and not holds(value)):  # _unusable's, cheaper: freed or shrunk (a view too)
                plans.append((key, value, skel, {}, [key]))  # read into a new tensor
            else:
                plans.append((key, value, skel, {key: value}, [key]))
            continue
        obj = refuse_unsupported(value, key, state, saving=False) or adapt(value, names)  # ZeRO, FSDP1 (fsdp1.py)
        skel, src_rank = rankload.skeleton_for(manifest, key, value, ctx.rank, ctx.world_size, later)
        if skel is None:
            continue
        if isinstance(obj, FSDP1OptimizerAdapter):  # its class and groups, before anything is read (fsdp1.py)
            obj.check_saved(skel, key)
        if callable(getattr(obj, "check_generators", None)):  # tg.RNGState's, before anything is read (genstate.py)
            try:
                obj.check_generators(skel, strict)
            except CheckpointError as err:
                err.args = (f"entry {key!r}: {err.args[0]}", *err.args[1:])
                raise
        prechecks.copy_of_object(key, value, skel, manifest)  # optimizer.state_dict() for the optimizer
        prechecks.before_read(key, obj, skel, strict)  # a GradScaler, a sampler: refused before anything is read
        if isinstance(obj, OptimizerAdapter):
            skel = canonical_optimizer(skel)  # saved with activation checkpointing's names (names.py)
            obj.other_names = other_names = other_names or param_name_map(state, other=True)
            obj.name_choices = choices = choices or param_name_choices(state)
            if split_state:  # the other stages' parameters stay theirs (split.py)
                mine = [p for g in obj.optimizer.param_groups for p in g["params"]]
                skel = split.prune_optimizer(skel, [*obj._index_names(False), *(other_names.get(id(p)) for p in mine),
                                                    *(n for p in mine for n in choices.get(id(p), ()))])  # every name of a tie
            obj.check_saved(skel, key, manifest)
        if strict and isinstance(value, torch.Tensor) and single_tensor(skel) is None:
            mismatched.append(f"{key} (the state holds one tensor, the checkpoint "
                              f"{'a structure' if isinstance(skel, (dict, list)) else f'a JSON value ({type(skel).__name__})'})")
        prefix = f"{key}@{src_rank}" if src_rank is not None else key
        cur = obj.state_dict() if has_state(obj) else value
        if split_state and src_rank is None and not isinstance(obj, OptimizerAdapter):
            skel = split.prune(skel, cur, isinstance(obj, ModuleAdapter))  # other ranks' stages' tensors stay theirs
        if not isinstance(obj, (ModuleAdapter, OptimizerAdapter)):
            current[key] = cur  # its dict types (a Counter, a defaultdict) are given back on load
            missing += gaps.missing(obj, cur, skel, prefix)  # a key added since the save (gaps.py)
        _, dest = flatten(cur, prefix)
        refs = tensor_refs(skel)
        if isinstance(obj, OptimizerAdapter):  # state it lacks: DTensor destinations, a parameter's new shape (optload.py)
            optload.fill_destinations(obj, skel, dest := alias_saved_paths(refs, dest), manifest, mismatched, bad)
        for p in refs:
            if p not in manifest.tensors:
                raise CorruptCheckpointError(f"manifest references tensor {p!r} that it does not describe", entry=p)
        # Modules have a fixed set of tensors: report every difference. Optimizers: shapes must
        # match (a fresh one has no state yet). Other objects: their load_state_dict decides; a
        # tensor whose shape changed is simply read into a new tensor.
        if isinstance(obj, ModuleAdapter):
            dest = obj.unwrapped_names(refs, dest, prefix + "/")  # an import without DDP's "module." prefix
            for p in (extra := obj.extra_state_paths([*dest, *refs], prefix)):
                dest.pop(p, None)  # set_extra_state takes what was saved, any shape: read into new tensors
            have, head, tied = set(refs), prefix + "/", obj.tied()  # a tie loads through any of its names
            added, gone = obj.extra_state_diff(skel, cur)  # get_extra_state() added or removed since the save
            missing, unexpected = missing + [head + k for k in added], unexpected + [head + k for k in gone]
            missing += [p for p in dest if p not in have and not any(head + n in have for n in tied.get(p[len(head) :], ()))]
            unexpected += [p for p in refs if p not in dest and p not in extra]
            resizable.drop_resized(obj.module, dest, head, manifest.tensors)  # QAT observers: resized by their load
        for p in refs:
            d = dest.get(p)
            if isinstance(d, UninitializedTensorMixin):  # a lazy module's: load_state_dict materializes it
                del dest[p]  # read into a new tensor (its shape and stride raise)
            elif d is not None:
                e = manifest.tensors[p]
                if (why := _unusable(d) or _expanded(d)) and isinstance(obj, (ModuleAdapter, OptimizerAdapter)):
                    # No memory of its own to read into: copy_ into it is a no-op or fails half-way, after other
                    # tensors were written, and the load looked done.
                    bad[p] = f"{p} (the state's tensor {why})"
                    mismatched.append(bad[p])
                elif why:
                    del dest[p]  # read into a new tensor, as for another shape
                elif list(d.shape) != e.shape or DTYPE_NAMES.get(d.dtype) != e.dtype or d.is_meta:
                    # A DTensor is never replaced: a full plain tensor would land on every rank.
                    if isinstance(obj, (ModuleAdapter, OptimizerAdapter)) or is_dtensor(d):
                        mismatched.append(f"{p} (checkpoint {e.dtype}{e.shape}, state {str(d.dtype)[6:]}{list(d.shape)})")
                        if list(d.shape) != e.shape or not castable(e.torch_dtype, d.dtype):  # else strict=False
                            bad[p] = mismatched[-1]  # reads it, then copy_ casts it (float4 has no cast: kept)
                    else:
                        del dest[p]
        if bad and isinstance(obj, OptimizerAdapter):  # a reshaped parameter's state: none of it read (optload.py)
            optload.keep_whole(obj, skel, bad)
        plans.append((key, obj, skel, dest, refs))
    rankload.refuse_or_report(strict, missing, unexpected, mismatched, manifest, ctx,  # strict=False: modules' left tensors warned
                              {k for k, o, *_ in plans if isinstance(o, ModuleAdapter)})
    rankload.record_keys(manifest, missing, unexpected, list(bad))  # the returned manifest's missing_keys, ...
    check_entries(manifest, {p[0]: state[p[0]] for p in plans},  # a scheduler's class; requires_grad changed: warn
                  {k: state[k] for k in missing_keys})  # strict=False: a scheduler added since the save
    if bad:  # by path, not the first word of each line: a path may hold a space ("my layer.weight")
        warnings.warn(
            f"strict=False: {len(bad)} tensor(s) that cannot take the checkpoint's values (another shape, no cast, no memory) keep their current "
            f"values: {', '.join(bad.values())[:1500]}",
            stacklevel=user_stacklevel(),
        )
    # Sizes on disk are checked before any destination is allocated: a manifest cannot make this rank allocate more
    # than the files it points at really hold. Before the plan round: a rank missing a file fails it on every rank.
    src = ChunkSource.of(storage, directory, manifest)
    wanted = check_needed(storage, directory, manifest, src, plans, bad)
    if ctx.is_distributed:  # the "load" round: nothing read into the state before every rank found that its state fits
        plan_round(taken={p for *_, refs in plans for p in refs} if split_state and strict and only is None else None)
        wrote.append(False)  # every rank passed the plan round (split_state's check too): the others read from here on
    finish: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging cpu tensor, live destination)
    loaded: dict[str, torch.Tensor] = {}
    want = {p: dest for _key, _obj, _skel, dest, refs in plans for p in refs if p not in bad}
    # In the manifest's order, which is the order the tensors were written in (file order).
    order = [p for p in manifest.tensors if p in want]
    skip, stage, differ = shared_destinations(order, want, manifest.tensors, src)  # tied weights, overlapping views
    if differ:
        warnings.warn("one tensor in the state (tied weights) holds different values under these names in the checkpoint; "
                      f"it takes the second's: {', '.join(f'{a} / {b}' for a, b in differ)[:1500]}", stacklevel=user_stacklevel())
    block = manifest.block_size
    same: list[tuple[str, str]] = []  # (alias, path read for its bytes), both into new tensors: one tensor, as torch.load gives
    first: dict[str, str] = {}  # a tie's target not read into a new tensor -> its alias that is, shared by the others

    def targets() -> Iterator[ReadTarget]:
        # A generator: the read threads plan tensor k+1 while tensor k's pieces are read.
        for p in order:
            e, live = manifest.tensors[p], want[p].get(p)
            if p in skip:  # the memory of a tensor read before it, the same bytes in the checkpoint
                loaded[p] = live
                continue
            if e.alias is not None and live is None:
                if e.alias in want and want[e.alias].get(e.alias) is None:
                    same.append((p, e.alias))
                    continue
                if e.alias in first:  # another name of the tie was read into a new tensor already
                    same.append((p, first[e.alias]))
                    continue
                first[e.alias] = p  # read below (its target is not loaded into a new tensor)
            if (
                p not in stage and type(live) is torch.Tensor and e.regular is None and len(e.chunks) == 1
                and in_place(live, e.torch_dtype)
            ):
                # A whole plain tensor stored in one chunk (validation: its box is the whole
                # tensor), read in place: the general path below without its per-tensor calls.
                c, box = e.chunks[0], full_box(e.shape)
                loaded[p] = live
                ops = [whole_read(box, c.file, c.offset, c.length, c.checksums, block, verify)] if c.length else []
                yield ReadTarget(p, live, box, ops)
                continue
            t, box, stage_back = _destination(live, e, stage=p in stage)
            loaded[p] = live if live is not None else t
            if stage_back is not None:
                finish.append((t, stage_back))
            ops = plan_reads(plan_args(src.chunks(p, e, box)), box, e.torch_dtype.itemsize, manifest.block_size, verify)
            yield ReadTarget(p, t, box, ops)

    # Every file is checked above (check_needed); a file not in ``wanted`` is one planned no read of (checked if opened).
    wrote += in_place_entries(plans, want)  # read in place from here on (partread.py)
    read_targets(storage, directory, targets() if len(want) <= EAGER_PLAN_FROM else list(targets()),
                 check_file=lambda f: None if f in wanted else check_file_sizes(storage, directory, manifest, {f}),
                 direct=_sole_reader(ctx))
    own = {p for _k, o, _s, _d, refs in plans if isinstance(o, (OptimizerAdapter, FSDP1OptimizerAdapter)) for p in refs}
    for p, target in same:  # an optimizer's state shared on save (FSDP1's flat step) is one per parameter in torch:
        loaded[p] = loaded[target].clone() if p in own else loaded[target]  # Adam stepped a shared step once per parameter
    for staged, live in finish:
        live.detach().copy_(staged)  # a plain entry's Parameter: nothing detached it (state_dict() does for modules)
    for key, obj, skel, dest, _refs in plans:
        if (p := single_tensor(skel)) is not None:  # an entry that is one tensor: no skeleton to walk
            value = loaded.get(p, dest.get(p))
        else:
            value = keep_types(unflatten(skel, lambda p, dest=dest: loaded.get(p, dest.get(p))), current.get(key))
            value = gaps.fill(obj, value, current.get(key))  # strict=False: such a key keeps its value
            if bad and isinstance(obj, OptimizerAdapter):  # a parameter whose shape changed: its state afresh
                value = optload.without_unread(obj, skel, value, dest, bad)
        try:
            if isinstance(obj, ModuleAdapter):
                obj.load_state_dict(value, strict=strict, versions=manifest.objects[key].get("versions"))
            elif has_state(obj):  # a GradScaler enabled since a save with it disabled: scalerstate.py
                scalerstate.keeps_fresh(key, obj, value, strict) or obj.load_state_dict(value)
            elif isinstance(state, MutableMapping):
                state[key] = refill(state[key], value)  # a dict entry filled in place: the script's references see it
            elif not same_values(value := refill(state[key], value), state[key]):
                raise CheckpointError(
                    f"entry {key!r}: the state is a read-only {type(state).__name__}, and this entry is replaced "
                    "on load (a JSON value, or a tensor whose shape or dtype changed); pass a dict"
                )
        except CheckpointError as err:  # from the object's own load_state_dict (a sampler's check): say which entry
            if err.args and isinstance(err.args[0], str) and not err.args[0].startswith("entry "):
                err.args = (f"entry {key!r}: {err.args[0]}", *err.args[1:])
            raise
        except (ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise mark_refusal(err, CheckpointError(
                f"entry {key!r}: its load_state_dict() refused the saved state: {err}. The object must be built "
                "the same way as when it was saved (same parameter groups, same configuration)"
            )) from err
        wrote.append(key)  # this entry is loaded: one after it that fails leaves it so
    rankload.run_deferred(later)


def _expanded(t: torch.Tensor) -> str:
    """Why ``t``'s elements share memory (``expand()``: a stride of 0 along a dimension of size > 1;
    ``unfold``, ``as_strided``: strides that overlap), or ""."""
    if t.layout != torch.strided or t.is_contiguous():  # 0.1 us: the 10,000-tensor path calls it for each
        return ""
    st = t.stride()
    if 0 in st and any(s == 0 and n > 1 for s, n in zip(st, t.shape, strict=True)) or may_overlap(local_part(t)):
        return (f"is expanded or a view whose elements overlap (strides {tuple(st)}: expand(), unfold(), as_strided()): "
                "its elements share memory and cannot take distinct values; give it memory of its own, e.g. with .clone()")
    return ""


def _unusable(t: torch.Tensor) -> str:
    """Why ``t`` holds no dense memory of its own that a load can read into (a meta, sparse or
    nested tensor, or one whose storage was freed), or ""."""
    if t.is_nested or t.layout is not torch.strided:
        return f"is {'nested' if t.is_nested else str(t.layout)[6:]}, not a dense tensor a load can read into"
    if t.is_meta:
        return "is on the meta device and holds no memory; call module.to_empty(device=...) before loading into it"
    if t.nbytes and not holds(local_part(t)):
        return ("has no memory: its storage was freed or shrunk (storage().resize_(), as FSDP1 does to unsharded "
                "parameters between forward and backward); load when the module holds its parameters")
    return ""


# Planning while reading pays off for large tensors; with thousands of small ones the planning
# thread holds the GIL while the readers' short preadv calls wait to get it back (10,000 tensors
# loaded hot: 0.78-0.81 s planned while reading, 0.70 s planned first): plan them all first.
EAGER_PLAN_FROM = 2000


def _sole_reader(ctx: DistContext) -> bool:
    """Whether cold files may be read with O_DIRECT: it bypasses the page cache, which is right
    for one process per machine and wrong when several ranks of this machine read the same
    bytes (replicated state: with the page cache the disk is read once for all of them;
    measured with 2 DDP ranks: O_DIRECT 2.43 s, through the cache 1.49 s). torchrun's
    ``LOCAL_WORLD_SIZE`` says how many ranks share this machine; unknown counts as several."""
    return ctx.world_size == 1 or os.environ.get("LOCAL_WORLD_SIZE") == "1"


def _destination(live: torch.Tensor | None, e: TensorEntry, stage: bool = False) -> tuple[torch.Tensor, Box, torch.Tensor | None]:
    """(tensor to read into, its box, live tensor to copy into afterwards or None). ``stage``:
    the live memory is shared with another destination (``aliases``): read beside it."""
    if live is None:
        t = torch.empty(e.shape, dtype=e.torch_dtype)
        return t, full_box(e.shape), None
    data, shape, offsets, _ = shard_of(live)
    box = Box(tuple(offsets), tuple(data.shape))
    if in_place(data, e.torch_dtype) and not stage:
        return data, box, None
    if data.dtype != e.torch_dtype:  # strict=False, dtype changed: read as saved, copy_ casts
        return torch.empty(tuple(data.shape), dtype=e.torch_dtype), box, data
    return torch.empty(tuple(data.shape), dtype=data.dtype), box, data

