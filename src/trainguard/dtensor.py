"""DTensor shards as trainguard sees them: the local box of a DTensor, whether this rank writes
it, whether it is a "regular" FSDP-style shard (manifest format 2), and lazily created optimizer
state for DTensor parameters. With ``dist.py``, the only module that imports torch.distributed
(lazily: plain tensors never import ``torch.distributed.tensor``).

Called on every rank by ``capture`` (save) and ``loader`` (load).
"""

from __future__ import annotations

from typing import Any


def shard_of(t: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...], bool]:
    """For a tensor leaf: ``(local tensor, global shape, global offsets of the local box, writer)``.

    Plain tensors are whole (offsets 0). A DTensor gives its local shard; ``writer`` is False
    on ranks that hold a replica of a box another rank writes (coordinate > 0 on a mesh
    dimension with a ``Replicate`` placement), so each box is written once.
    """
    if not is_dtensor(t):
        shape = tuple(t.shape)
        return t, shape, (0,) * len(shape), True
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(
                f"DTensor with placement {p} cannot be saved as is; call .redistribute() to Shard/Replicate first"
            )
    coord = mesh.get_coordinate()
    if coord is None and t.dim():
        # This rank is outside the DTensor's mesh (a mesh over some of the ranks): it holds none of
        # it. torch gives its local shape as (0,) with no offsets, a box of another rank than the
        # tensor's, which broke the load's read planning: an empty box of the tensor's rank instead.
        return t.to_local().new_empty((0,) * t.dim()), tuple(t.shape), (0,) * t.dim(), False
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coord = coord or []
    writer = all(c == 0 for c, p in zip(coord, placements, strict=False) if isinstance(p, Replicate))
    return t.to_local(), tuple(t.shape), tuple(offsets), writer


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


def ensure_optimizer_state(optimizer: Any) -> bool:
    """Give a fresh optimizer over DTensor parameters its state, so a load can read shards into it.

    Called by ``api.load`` on every rank before loading optimizer state. It does nothing when the
    optimizer already has state or holds no DTensor parameter (plain tensors are read into new
    whole tensors and handed to ``optimizer.load_state_dict``). Otherwise it runs one
    ``step()`` with zero gradients and every learning rate set to 0, which creates each state
    tensor with its parameter's sharding and leaves the parameters unchanged; the loaded values
    then overwrite that state. Returns True when it created state.
    """
    import torch

    if optimizer.state or not any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"]):
        return False
    saved_lr = []
    for g in optimizer.param_groups:
        saved_lr.append(g.get("lr"))
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"] = g["lr"].clone().fill_(0.0)
        elif "lr" in g:
            g["lr"] = 0.0
    grads = {}
    try:
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    grads[p] = p.grad
                    p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for p, old in grads.items():
            p.grad = old
        for g, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            if lr is not None:
                g["lr"] = lr
    return True
