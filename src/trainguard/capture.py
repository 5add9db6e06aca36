"""Phase 1 of a save, on every rank: take the live state apart into JSON skeletons and tensor
leaves, and decide which chunks this rank writes. Synchronous and cheap: tensors are
referenced, not copied (the async path copies them in its stage phase), except a
non-contiguous one (channels_last, a transposed view), saved from a contiguous copy taken here.
A tensor held under several names (tied weights) is written once, under its first name; each
later name is an alias leaf (``tied.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin

from . import ddpjoin, walks
from .buffers import holds, may_overlap
from .commhooks import warn_unsaved
from .dist import DistContext
from .distwait import note_busy
from .dtensor import is_dtensor, regular_dim, shard_of, split_peers
from .dtypes import DTYPE_NAMES
from .errors import CheckpointError, RankFailureError, UnsupportedValueError
from .flatten import flatten
from .fsdp1 import refuse_unsupported
from .manifest import MAX_NDIM, MAX_TENSOR_BYTES
from .names import frozen_names, module_versions
from .optnames import param_name_map
from .planner import Box, Regular, full_box
from .replicas import digests, plan, refuse_subgroup_ddp, state_buffer_sources
from .sampler import ResumableIterable, ResumableSampler
from .schedclass import scheduler_class
from .stateful import adapt, check_state, has_state, is_rank_local
from .tied import PLAIN, remember, same_view
from .zero import refuse_diverged


@dataclass
class Leaf:
    """One tensor of the captured state, as this rank holds it."""

    path: str
    tensor: torch.Tensor  # local data (the shard for a DTensor)
    dtype: str
    shape: tuple[int, ...]  # global shape
    box: Box  # the local box in global coordinates
    kind: str  # "replicated" | "sharded" | "local" | "full" | "alias"
    writer: bool = True
    regular: Regular | None = None  # Shard(d) over all ranks: saved in format 2's compact form
    alias: str | None = None  # kind "alias": the path of the leaf holding the bytes (never written)
    peers: tuple[int, ...] | None = None  # a DTensor on a mesh slice: the ranks that may hold its box (dtensor.split_peers)
    source: int | None = None  # a replicated buffer DDP broadcasts from this rank: written by it (replicas.buffer_sources)


@dataclass
class Snapshot:
    """What ``capture`` took from the live state: JSON skeletons (copied now) and tensor refs."""

    objects: dict[str, Any]
    rank_local: list[str]
    leaves: list[Leaf]
    entry_sig: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # the save's, as at the call (api._collective_capture)
    split: bool = False  # split_state=True: ranks may hold different entries (split.py)
    frozen: dict[str, list[str]] = field(default_factory=dict)  # module entry -> its frozen parameters (names.py)
    versions: dict[str, dict[str, int]] = field(default_factory=dict)  # module entry -> its modules' versions (names.py)
    classes: dict[str, str] = field(default_factory=dict)  # scheduler entry -> its class (schedclass.py)

    def beside(self, key: str) -> dict[str, Any]:
        """``api``: what the manifest keeps beside entry ``key``'s skeleton ("frozen", "versions", "class")."""
        return {**({"frozen": self.frozen[key], "versions": self.versions[key]} if key in self.frozen else {}),
                **({"class": self.classes[key]} if key in self.classes else {})}
    data_positions: dict[str, Any] = field(default_factory=dict)  # shared samplers' states: check_data_positions
    replicas: dict[str, Any] | None = None  # digests of the replicated leaves, taken at the call (replicas.py)


def _check_key(key: Any) -> str:
    if type(key) is not str or not key or "/" in key or "@" in key or key.startswith("$"):
        raise UnsupportedValueError(
            f"state key {key!r}: top-level keys must be non-empty strings without '/' or '@'"
        )
    return key


def capture(state: Mapping[str, Any], *, ctx: DistContext, layout_kind: str = "sharded", split: bool = False) -> Snapshot:
    """Take the state apart into JSON skeletons and tensor leaves (every rank, synchronously).

    Tensors are referenced, not copied (non-contiguous ones excepted); async saving copies them
    in its stage phase. ``split`` (``split_state=True``, from ``api._collective_capture``): a
    DTensor on a mesh slice may be this rank's to write (``my_chunks`` decides, knowing the groups).
    """
    with walks.shared():  # each module walked once for the checks below (walks.py)
        return _capture(state, ctx, layout_kind, split)


def _capture(state: Mapping[str, Any], ctx: DistContext, layout_kind: str, split: bool) -> Snapshot:
    check_state(state)
    names = param_name_map(state)
    objects: dict[str, Any] = {}
    rank_local: list[str] = []
    leaves: list[Leaf] = []
    # Address of a plain tensor's first element -> (tensor, its leaf), or a dict of them by view
    # for several views starting there (tied.remember): the tensors stay referenced until the
    # capture ends, so no address is reused by a later temporary. 0.3-0.5 us a tensor (bench/tie_cost.py).
    seen: dict[int, Any] = {}
    ties: list[tuple[str, str]] = []  # (alias, target)
    data_positions: dict[str, Any] = {}
    frozen: dict[str, list[str]] = {}
    versions: dict[str, dict[str, int]] = {}
    classes: dict[str, str] = {}
    # address of a buffer DDP syncs (and of the state's other module buffers then) -> the rank saving it
    sources = state_buffer_sources(state) if ctx.world_size > 1 else {}
    if ctx.world_size > 1:
        warn_unsaved(state, ctx.rank)  # a DDP comm hook (PowerSGD) whose state is not in the state
        ddpjoin.note(state)  # DDP under Join: a rank that joined never reaches this save (a timeout's hint)
        note_busy(ctx, "capturing its state for the save (state_dict() and hooks)")  # a timeout's message names it
        if not split:
            refuse_subgroup_ddp(state, ctx.world_size)  # DDP over a subgroup: the other ranks hold other replicas
    for key, value in state.items():
        _check_key(key)
        local = is_rank_local(value)
        if type(value) in PLAIN and not local and not has_state(value):
            # An entry that is one shared tensor (a flat dict of 10,000): what adapt() and
            # flatten() give it, without their calls and type checks.
            objects[key], tensors = {"$t": key}, {key: value}
        else:
            obj = refuse_unsupported(value, key, state, saving=True) or adapt(value, names)  # ZeRO, FSDP1 (fsdp1.py)
            if isinstance(value, torch.optim.Optimizer):
                refuse_diverged(value, key, state, ctx.world_size)  # local SGD: entries that are not rank-local would be mixed
            try:
                sd = obj.state_dict() if has_state(obj) else obj
            except Exception as e:  # said which entry: "could not capture the state: boom" did not
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"entry {key!r}: its state_dict() raised {type(e).__name__}: {e}") from e
            if local:
                rank_local.append(key)
            deques = not isinstance(value, (torch.optim.Optimizer, torch.nn.Module))  # loaded back as deques
            try:
                skel, tensors = flatten(sd, f"{key}@{ctx.rank}" if local else key, deques=deques)
            except UnsupportedValueError as e:  # a scheduler's attribute: what to change is in the scheduler
                what = str(e).split(";")[0]
                if isinstance(value, torch.optim.lr_scheduler.LRScheduler) and "cannot be saved" in what:
                    e.args = (what + SCHEDULER_HINT,)
                elif isinstance(value, torch.optim.Optimizer) and "cannot be saved" in what:
                    e.args = (what + OPTIMIZER_HINT,)
                raise
            objects[key] = skel
            if (cls := scheduler_class(value)) is not None:
                classes[key] = cls  # refused on load by a scheduler of another class
            if isinstance(value, torch.nn.Module) and not local:
                if not split:
                    frozen[key], versions[key] = frozen_names(value), module_versions(value, getattr(obj, "metadata", None))
            if not local and isinstance(value, (ResumableSampler, ResumableIterable)):
                # Global: every rank that reads data must hold the same (check_data_positions).
                data_positions[key] = [skel, bool(getattr(value, "reads_data", True))]
        for path, t in tensors.items():
            ptr = 0  # the address of a plain tensor of a shared entry; 0: none, or not checked
            if not local and type(t) in PLAIN:
                try:
                    ptr = t.data_ptr()
                except RuntimeError:  # sparse, meta...: no memory of its own (_leaf refuses it)
                    pass
            if ptr and (hit := seen.get(ptr)) is not None and (first := same_view(hit, t)) is not None:
                # The same view of the same memory as an earlier name (a tie): written once, as that.
                leaves.append(replace(first, path=path, kind="alias", writer=False, alias=first.path))
                ties.append((path, first.path))
                continue
            lf = _leaf(path, t, local, layout_kind, ctx.rank, ctx.world_size)
            if ptr and lf.kind == "replicated" and sources:
                lf.source = sources.get(ptr)
            if split and lf.peers is not None:
                lf.writer = True  # a candidate: staged by an async save, narrowed by my_chunks
            leaves.append(lf)
            if ptr:
                remember(seen, ptr, t, lf)
    # Ranks must agree on the ties too: which tensors each rank writes depends on them. One process
    # compares it with no one (0.5 ms of an async save's call for 632 tensors: not computed).
    sig = hashlib.sha1(
        json.dumps(
            [sorted(state), sorted(rank_local), sorted((lf.path, lf.shape, lf.dtype, lf.regular and lf.regular.dim, lf.source) for lf in leaves if lf.kind != "local"), sorted(ties)]
        ).encode()
    ).hexdigest() if ctx.world_size > 1 else ""
    rep = digests(state, leaves, ctx.world_size, sig, layout_kind)  # compared in the begin round: replicas.compare
    return Snapshot(objects=objects, rank_local=rank_local, leaves=leaves, entry_sig=sig, split=split, data_positions=data_positions,
                    frozen=frozen, versions=versions, classes=classes, replicas=rep)


# ``capture``: what to do about a value refused in an optimizer's state (a key added to a param group, or its
# lr set from numpy): flatten's "wrap it in a class with state_dict()" and "give it its own key" cannot apply there.
OPTIMIZER_HINT = (
    ": an optimizer's state_dict() holds every key of each param group (lr, betas... and any key the script adds to "
    "a group, such as a 'name') and each parameter's state: keep them tensors or JSON values (float(x) for a numpy "
    "number, str(x) for a torch.device), or keep other objects out of the param groups (in a dict of the script's own, "
    "keyed by the group's index or 'name')"
)


# ``capture``: what to do about a value refused in a scheduler's state, after its path and type (flatten's
# own hints, "wrap it in a class with state_dict()", "give it its own key", do not apply to an attribute).
SCHEDULER_HINT = (
    ": a scheduler's state_dict() holds all of its attributes but its optimizer, and LambdaLR's, MultiplicativeLR's "
    "and CyclicLR's also those of an lr_lambda or scale_fn that is an object (not a function): keep such attributes "
    "tensors or JSON values (float(x) for a numpy number; self.warmup = cfg.warmup, not self.cfg = cfg; no reference to "
    "the optimizer or model), pass a function or a functools.partial instead (torch saves no attribute of a function, "
    "nor a partial's arguments), or override the scheduler's "
    "state_dict()/load_state_dict() to leave that attribute out"
)


def check_data_positions(begin: list[Any]) -> None:
    """``api._check_begin``, on every rank with the same ``begin`` round: a shared
    ``ResumableSampler``/``ResumableIterable`` entry must hold the same state on every rank. The
    checkpoint keeps rank 0's as everyone's, so ranks that advanced differently (a rank that missed
    an ``advance``, or called it with another ``n``) would resume silently misaligned. Not
    compared: ranks without the entry (other stages, ``split_state``) and, but for rank 0 whose
    state the checkpoint keeps, ranks that never iterated nor advanced it (``reads_data``: a middle
    pipeline stage that holds the loader and reads no batch)."""
    for key, (first, _) in (begin[0].get("data") or {}).items():
        held = [(r, b["data"][key]) for r, b in enumerate(begin) if key in (b.get("data") or {})]
        off = {r: got for r, (got, reads) in held if (reads or r == 0) and got != first}
        if off:
            others = ", ".join(f"rank {r} has {v}" for r, v in sorted(off.items()))
            raise RankFailureError(
                f"save: entry {key!r} (a data position, global) differs between ranks: rank 0 has {first}, {others}. "
                "Every rank must call advance(n) once per step with the same n (what it consumed, len(batch)), "
                "(a rank that never iterates nor advances its copy, such as a pipeline stage reading no batch, is not "
                "compared, unless it is rank 0); "
                "the checkpoint would keep rank 0's position for all. A sampler of each rank's own (its own "
                "shard or seed) needs trainguard_rank_local = True (docs/distributed.md)",
                {r: f"entry {key!r} is {v}, rank 0's is {first}" for r, v in off.items()},
            )


_COMPLEX = frozenset(n for n in DTYPE_NAMES.values() if n.startswith("complex"))


def _leaf(path: str, t: torch.Tensor, local: bool, layout_kind: str, rank: int = 0, world: int = 1) -> Leaf:
    full = layout_kind == "full" and not local
    if (type(t) in PLAIN and not full and not t.is_nested and t.layout is torch.strided
            and (dtype := DTYPE_NAMES.get(t.dtype)) is not None):
        # The common case (10,000 small tensors): a dense, contiguous, non-empty plain tensor that
        # every check below passes, as they would find; anything else takes them (they may raise).
        shape = tuple(t.shape)  # after is_nested: a nested tensor has no shape
        # Implied, not asked (0.4 us a tensor of the call): a quantized dtype is no stored dtype, a meta
        # tensor's storage has no address (holds), only a complex tensor has a conjugate bit.
        if (dtype not in _COMPLEX or not t.is_conj()) and not t.is_neg() and t.is_contiguous() \
                and len(shape) <= MAX_NDIM and 0 < t.nbytes <= MAX_TENSOR_BYTES and holds(t):
            kind = "local" if local else "replicated"
            box = full_box(shape)  # shared: fewer objects for the garbage collector (see there)
            # A view of the memory as at the call, also for a tensor without autograd: an async
            # save copies it later, and `t.data = other` meanwhile must not redirect that copy.
            return Leaf(path, t.detach(), dtype, box.sizes, box, kind)
    dt = is_dtensor(t)
    if dt and full:
        if t.device_mesh.get_coordinate() is None:  # full_tensor() would give this rank a (0,) tensor
            raise UnsupportedValueError(
                f"{path}: layout='full' needs every DTensor on a mesh of all ranks, and rank {rank} is outside this "
                "one's; save sharded (the default) and make a full copy offline with `trainguard consolidate`"
            )
        t, dt = t.full_tensor(), False  # collective on the training group: every rank reaches it in the same order
    if dt:
        data, shape, offsets, writer = shard_of(t, path)
    else:  # a plain tensor (shard_of's answer, without its checks)
        _refuse_kind(path, t)  # first: a nested tensor has no shape
        data, shape, writer = t, tuple(t.shape), True
        offsets = (0,) * len(shape)
    if dt:
        _refuse_kind(path, data)
    if data.is_conj() or data.is_neg():
        raise UnsupportedValueError(
            f"{path}: tensor is a lazy conjugate/negative view (its memory does not hold its values); "
            "call .resolve_conj() / .resolve_neg() on it before saving"
        )
    if not data.is_contiguous() and may_overlap(data):
        raise UnsupportedValueError(
            f"{path}: tensor's elements share memory (strides {tuple(data.stride())}: an expand()ed or "
            "as_strided view); save the tensor it was expanded from, or call .contiguous() on it "
            "(a full copy) before saving"
        )
    _check_shape(path, shape, data.element_size())
    kind = "local" if local else ("sharded" if dt else "replicated")
    if full:
        # layout="full": whole tensors, one chunk each, all in rank 0's file (export/inference).
        kind, writer = "full", rank == 0
        if rank != 0:
            data = data.new_empty((0,) * data.dim())  # others only need shape and dtype
    if not data.is_contiguous():
        # channels_last weights (and Adam's moments, which follow them), transposed or sliced
        # views: saved as a contiguous copy of their values, taken now (a snapshot, as a save
        # is), at the cost of that copy's memory until the save has written it.
        data = data.contiguous()
    box = full_box(shape) if full else Box(tuple(offsets), tuple(data.shape))
    regular = None
    d = regular_dim(t, world) if dt and not local else None
    if d is not None and world > 1:
        regular = Regular(d, world)
        if regular.part_box(shape, rank) != box:  # torch changed its chunking: stay explicit
            regular = None
    peers = split_peers(t) if dt and kind == "sharded" else None
    return Leaf(path, data.detach(), DTYPE_NAMES[data.dtype], shape, box, kind, writer, regular, peers=peers)


def _refuse_kind(path: str, t: torch.Tensor) -> None:
    """``_leaf``: refuse, at save time and saying what to do, a tensor whose memory is not a
    dense array of its values in a stored dtype (they failed later, or with torch's words)."""
    what = None
    if isinstance(t, UninitializedTensorMixin):  # its shape raises
        what = "an uninitialized parameter of a lazy module (nn.LazyLinear...) holds no data; run a forward pass before saving"
    elif t.is_nested:
        what = "nested tensors cannot be saved; save its components (.unbind()) or a padded tensor (.to_padded_tensor(0))"
    elif type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        what = (
            f"tensor subclass {type(t).__qualname__} keeps its data in inner tensors; save plain tensors "
            "instead (its components from __tensor_flatten__(), or a conversion such as .dequantize())"
        )
    elif t.layout is not torch.strided:
        what = (
            f"{str(t.layout)[6:]} tensors cannot be saved, only dense ones; save .to_dense(), or its parts "
            "(.indices()/.values(); .crow_indices()/.col_indices()/.values() for CSR) as tensors"
        )
    elif t.is_quantized:
        what = (
            f"quantized tensors ({t.dtype}) cannot be saved; save .int_repr() with its q_scale()/q_zero_point() "
            "(q_per_channel_scales()/..._zero_points() per channel), or .dequantize()"
        )
    elif t.is_meta:
        what = (
            "a meta tensor holds no data; materialise the module first (module.to_empty(device=...), "
            "then initialise it or load weights into it)"
        )
    elif t.dtype not in DTYPE_NAMES:
        what = (
            f"dtype {t.dtype} is not supported (stored dtypes: {', '.join(DTYPE_NAMES.values())}); "
            "convert it to one of them with .to(dtype)"
        )
    elif t.nbytes and not holds(t):  # it saved the heap's bytes, or crashed an async save's copy
        what = (f"the tensor's memory was freed or shrunk (its storage holds {t.untyped_storage().nbytes()} of its "
                f"{t.nbytes} bytes: storage().resize_(), as FSDP1 does to unsharded parameters between forward and "
                "backward); save when its module holds its values (after optimizer.step(), or FSDP1's state_dict())")
    if what:
        raise UnsupportedValueError(f"{path}: {what}")


def _check_shape(path: str, shape: tuple[int, ...], itemsize: int) -> None:
    """``_leaf``: refuse a shape that ``manifest.parse`` would refuse as corrupt (a save that
    committed it could never be loaded)."""
    if len(shape) > MAX_NDIM:
        raise UnsupportedValueError(
            f"{path}: tensor has {len(shape)} dimensions, checkpoints hold at most {MAX_NDIM}; "
            "reshape it before saving (and back after loading)"
        )
    nbytes = itemsize
    for s in shape:
        if s > MAX_TENSOR_BYTES:
            raise UnsupportedValueError(f"{path}: a dimension of {s} exceeds the limit of {MAX_TENSOR_BYTES}; reshape it")
        nbytes *= max(s, 1)
    if nbytes > MAX_TENSOR_BYTES:
        raise UnsupportedValueError(f"{path}: tensor exceeds the limit of {MAX_TENSOR_BYTES} bytes; split it")


def my_chunks(snap: Snapshot, ctx: DistContext, base_loads: list[int], group: list[int] | None = None) -> list[tuple[Leaf, Box]]:
    """The chunks this rank writes: its shards, its rank-local tensors, and its balanced share
    of the replicated tensors (the same deterministic assignment on every rank). ``group``: with
    ``split_state``, the ranks holding the same entries as this one, which share its replicated tensors."""
    if ctx.world_size == 1:  # everything is this rank's, whole (what the balancing below gives)
        mine = [(lf, lf.box) for lf in snap.leaves if lf.kind == "replicated" or lf.writer]
        mine.sort(key=lambda c: (c[0].path, c[1].offsets))
        return mine
    ranks = group if group is not None else list(range(ctx.world_size))
    me, loads = ranks.index(ctx.rank), [base_loads[r] for r in ranks]
    mine = [(lf, b) for lf, b, r in plan(snap.leaves, ranks, loads, group is not None) if r == me]  # DDP's buffers: by its source
    if group is None:
        mine += [(lf, lf.box) for lf in snap.leaves if lf.kind != "replicated" and lf.writer]
    else:  # a DTensor on a mesh slice: written by the first of its peers that hold this rank's entries
        ours = set(group)
        mine += [(lf, lf.box) for lf in snap.leaves if lf.kind != "replicated" and lf.writer
                 and (lf.peers is None or min(p for p in lf.peers if p in ours) == ctx.rank)]
    # In path order (the balancing above goes by size): the file holds the tensors in this
    # order, the manifest lists them so, and a load plans them so, reading each file front to back.
    mine.sort(key=lambda c: (c[0].path, c[1].offsets))
    return mine


def chunk_view(leaf: Leaf, box: Box) -> torch.Tensor:
    """The contiguous CPU-side tensor holding ``box`` of ``leaf`` (a row range or the whole)."""
    t = leaf.tensor
    if box is not leaf.box and box != leaf.box:  # a dim-0 row range of a replicated tensor (no __eq__ call per whole tensor)
        t = t[box.offsets[0] : box.offsets[0] + box.sizes[0]]
    return t
