"""DTensor shards as trainguard sees them: the local box of a DTensor, whether this rank writes
it, whether it is a "regular" FSDP-style shard (manifest format 2), and lazily created optimizer
state for DTensor parameters. With ``dist.py``, the only module that imports torch.distributed
(lazily: plain tensors never import ``torch.distributed.tensor``).

Called on every rank by ``capture`` (save) and ``loader`` (load).
"""

from __future__ import annotations

from typing import Any


def shard_of(t: Any, path: str | None = None) -> tuple[Any, tuple[int, ...], tuple[int, ...], bool]:
    """For a tensor leaf: ``(local tensor, global shape, global offsets of the local box, writer)``.

    Plain tensors are whole (offsets 0). A DTensor gives its local shard; ``writer`` is False
    on ranks that hold a replica of a box another rank writes (coordinate > 0 on a mesh
    dimension with a ``Replicate`` placement, or along a dim of the larger mesh that the
    DTensor's mesh is a slice of: ``first_replica``), so each box is written once. A ``Shard``
    DTensor whose local shard is not torch's split (:func:`refuse_uneven`) raises
    ``UnsupportedValueError`` naming ``path`` (the capture's and the load's tensor).
    """
    if not is_dtensor(t):
        shape = tuple(t.shape)
        return t, shape, (0,) * len(shape), True
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = t.device_mesh, t.placements
    for p in placements:
        if not isinstance(p, (Shard, Replicate, _StridedShard)):
            raise TypeError(
                f"DTensor with placement {p} cannot be saved or loaded into as is; call .redistribute() to Shard/Replicate first"
            )
    coord = mesh.get_coordinate()
    if coord is None and t.dim():
        # This rank is outside the DTensor's mesh (a mesh over some of the ranks): it holds none of
        # it. torch gives its local shape as (0,) with no offsets, a box of another rank than the
        # tensor's, which broke the load's read planning: an empty box of the tensor's rank instead.
        return t.to_local().new_empty((0,) * t.dim()), tuple(t.shape), (0,) * t.dim(), False
    if any(isinstance(p, _StridedShard) for p in placements):
        # FSDP2 over a tensor-parallel model: torch's offsets give only each dim's first index.
        offsets = strided_offsets(tuple(t.shape), tuple(mesh.shape), coord, placements, tuple(t.to_local().shape))
    else:
        local_shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        if tuple(local_shape) != tuple(t.to_local().shape):
            refuse_uneven(t, tuple(local_shape), path)
    coord = coord or []
    writer = all(c == 0 for c, p in zip(coord, placements, strict=False) if isinstance(p, Replicate))
    return t.to_local(), tuple(t.shape), tuple(offsets), writer and first_replica(mesh)


def refuse_uneven(t: Any, expected: tuple[int, ...], path: str | None) -> None:
    """:func:`shard_of`, on the rank whose local shard of DTensor ``t`` is not the ``expected`` shape
    that torch's split of ``t.shape`` over its mesh gives this rank (``torch.chunk``'s sizes): a
    ``DTensor.from_local(..., shape=, stride=)`` of other split sizes (rows 3 and 5 of 8 on 2 ranks).
    Its offsets are known to no rank (torch's are the even split's), so neither a save nor a load
    can place it: refused, naming the tensor, the sizes and the split that works. Every rank raises
    it in its own capture (save) or plan (load); each one's error reaches the others through the
    operation's first round. Before (polish58) a save wrote the box at the even split's offset,
    past the tensor's end (``chunk extends past the tensor`` at every load)."""
    from .errors import UnsupportedValueError

    local = tuple(t.to_local().shape)
    mesh = t.device_mesh
    dims = [d for d, (a, b) in enumerate(zip(local, expected, strict=True)) if a != b]
    split = ""
    if mesh.ndim == 1 and dims:
        n, d = mesh.size(), dims[0]
        c = -(-t.shape[d] // n)
        split = f" (torch.chunk: {', '.join(str(max(0, min(c, t.shape[d] - i * c))) for i in range(n))} rows of dim {d} over the {n} ranks)"
    name = f"tensor {path!r}" if path else "a DTensor"
    raise UnsupportedValueError(
        f"{name}: DTensor of shape {tuple(t.shape)} with placements {tuple(t.placements)} holds a local shard of "
        f"{local} on rank {t.device_mesh.get_rank()}, where torch's split gives this rank {expected}{split}: a DTensor "
        "built by DTensor.from_local with other (uneven) split sizes cannot be saved or loaded into, since no rank "
        "knows where its shard starts. Give each rank torch's part of the full tensor "
        "(distribute_tensor(full, mesh, placements), or DTensor.from_local of its .to_local()), or save its local "
        "shards as a rank-local entry (an object with trainguard_rank_local = True)"
    )


_FIRST: dict[int, tuple[Any, bool, tuple[int, ...] | None]] = {}


def first_replica(mesh: Any) -> bool:
    """False when ``mesh`` is a slice of a larger mesh (``mesh["tp"]`` of a dp x tp mesh: a
    tensor-parallel model replicated over "dp") and this rank's coordinate is not 0 along a dim
    of the larger mesh that the slice does not span: the tensor is taken to be replicated along
    those dims, as along a ``Replicate`` placement, and one replica writes it. Every replica used
    to write its copy, so the manifest listed each box several times and no load accepted it.

    ``shard_of`` asks, for every DTensor leaf; answers are kept per mesh object.
    """
    return _slice_info(mesh)[0]


def split_peers(t: Any) -> tuple[int, ...] | None:
    """``capture._leaf``, for a DTensor leaf: when its mesh is a slice of a larger mesh and its
    placements make this rank a writer of its box, the ranks that hold the same box along the
    dims the slice does not span (this rank included); None otherwise. ``first_replica`` takes
    them all for replicas; with ``split_state`` they are only where they hold the same entries
    (pipeline stages on ``mesh["dp"]`` of a pp x dp mesh are not replicas of each other), so
    ``capture.my_chunks`` picks the writer among those of this rank's group."""
    from torch.distributed.tensor import Replicate

    peers = _slice_info(t.device_mesh)[1]
    coord = t.device_mesh.get_coordinate()
    if peers is None or coord is None:
        return None
    if any(c != 0 for c, p in zip(coord, t.placements, strict=False) if isinstance(p, Replicate)):
        return None
    return peers


def _slice_info(mesh: Any) -> tuple[bool, tuple[int, ...] | None]:
    """``first_replica``'s answer and ``split_peers``' ranks for ``mesh``, kept per mesh object."""
    hit = _FIRST.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    answer, peers = True, None
    if root is not mesh and (coord := root.get_coordinate()) is not None:
        ranks = root.mesh
        where = [(ranks == r).nonzero()[0].tolist() for r in mesh.mesh.flatten().tolist()]
        fixed = [d for d in range(ranks.dim()) if len({w[d] for w in where}) == 1]
        answer = all(coord[d] == 0 for d in fixed)
        peers = tuple(sorted(ranks[tuple(slice(None) if d in fixed else coord[d] for d in range(ranks.dim()))].flatten().tolist()))
    if len(_FIRST) > 4096:
        _FIRST.clear()
    _FIRST[id(mesh)] = (mesh, answer, peers)
    return answer, peers


def strided_offsets(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int], placements: Any, local: tuple[int, ...]
) -> tuple[int, ...]:
    """The global offsets of this rank's box of a DTensor with a ``_StridedShard`` placement
    (what ``fully_shard`` gives a tensor-parallel parameter: ``(_StridedShard(0, sf=tp), Shard(0))``).

    ``shard_of`` calls it. Placements apply left to right as torch's do: ``Shard`` takes
    ``torch.chunk`` piece ``c`` of the indices so far, ``_StridedShard(d, sf)`` cuts them into
    ``sf`` chunks and takes piece ``c`` of each. Indices are kept as ``(start, stop)`` runs, so
    the cost grows with the number of runs, not rows. A rank's indices that are not one run
    (its rows are not next to each other in the tensor) cannot be one box, nor can a run whose
    length is not the local tensor's (``local``, its shape): both refused.
    """
    from torch.distributed.tensor import Replicate

    runs: dict[int, list[tuple[int, int]]] = {}
    for md, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        d = p.dim % len(shape)
        cur = runs.get(d, [(0, shape[d])] if shape[d] else [])
        n, sf = sum(b - a for a, b in cur), int(getattr(p, "split_factor", 1))
        k, c = mesh_shape[md], coord[md]
        out: list[tuple[int, int]] = []
        step = -(-n // sf)
        for s in range(sf):
            lo, hi = min(s * step, n), min((s + 1) * step, n)
            size = -(-(hi - lo) // k)
            out += _take(cur, lo + min(c * size, hi - lo), lo + min((c + 1) * size, hi - lo))
        runs[d] = out
    offsets = [0] * len(shape)
    for d, rs in runs.items():
        merged: list[tuple[int, int]] = []
        for a, b in rs:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        if len(merged) > 1 or sum(b - a for a, b in merged) != local[d]:
            raise TypeError(
                f"DTensor with placements {tuple(placements)} of shape {shape}: this rank's part of dim {d} is "
                f"not one run of its {local[d]} local indices ({merged}), so it cannot be saved or loaded as a box; call .redistribute() to "
                "Shard/Replicate first"
            )
        offsets[d] = merged[0][0] if merged else shape[d]  # empty: torch's offset for an empty shard
    return tuple(offsets)


def _take(runs: list[tuple[int, int]], i: int, j: int) -> list[tuple[int, int]]:
    """Elements ``i:j`` of the concatenation of ``runs`` (``strided_offsets``), as runs."""
    out, pos = [], 0
    for a, b in runs:
        lo, hi = max(i - pos, 0), min(j - pos, b - a)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += b - a
    return out


def regular_dim(t: Any, world_size: int) -> int | None:
    """The dim ``d`` when DTensor ``t`` is one ``Shard(d)`` on a 1-D mesh of exactly ranks
    0..world_size-1 in order (FSDP2's default), so that rank i holds ``torch.chunk`` part i:
    ``capture`` then saves it in the compact "regular" form. None for anything else."""
    if not is_dtensor(t) or t.dim() == 0:
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard:  # not _StridedShard
        return None
    if mesh.mesh.flatten().tolist() != list(range(world_size)):
        return None
    d = placements[0].dim % t.dim()
    return d


_DTENSOR: Any = None
_PLAIN: tuple[type, ...] = ()


def _plain_types() -> tuple[type, ...]:
    import torch

    return (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t: Any) -> bool:
    """True for a DTensor (the class is imported once: this runs for every leaf)."""
    global _DTENSOR, _PLAIN
    if not _PLAIN:
        _PLAIN = _plain_types()
    if type(t) in _PLAIN:  # fast path: no import of torch.distributed.tensor (~0.3 s) when unused
        return False
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor as _DTENSOR
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR = ()
    return isinstance(t, _DTENSOR)


def local_part(t: Any) -> Any:
    """The tensor whose memory this rank holds: a DTensor's local shard, else ``t`` (or None).
    ``aliases`` (the load's overlap check) and ``stage.protected_tensors`` (async saves) ask."""
    return t.to_local() if t is not None and is_dtensor(t) else t


def reshard_fsdp2(modules: Any) -> None:
    """``stateful.param_name_map`` (``capture.capture`` on save, ``loader._load`` on load, every
    rank; local, no collective): reshard every FSDP2 (``fully_shard``) module of ``modules``. With
    ``reshard_after_forward=False`` a forward (an eval pass before the save) leaves the unsharded
    plain parameters registered, not the DTensors the optimizer holds: its state was keyed by index
    (a warning) and the checkpoint did not load into a model built afresh. ``state_dict()`` reshards too."""
    import sys

    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp_module is None:  # FSDP2 never imported: nothing to reshard
        return
    from .walks import modules as walk

    for module in modules:
        for sub in walk(module):  # the save call's one walk of the module (walks.py)
            if isinstance(sub, fsdp_module):
                sub.reshard()
