"""Destinations of a load that share memory: tied weights (``lm_head.weight`` IS ``wte.weight``,
two names in a module's ``state_dict()``, one tensor; FSDP2 ties alike, by their local shards)
and overlapping views in a plain state (``{"a": base, "b": base[2:8]}``).

``loader._load`` reads each tensor straight into its destination, on several threads, and
verifies its bytes there. Two reads into the same memory raced: when the checkpoint holds
different bytes for them (saved untied, loaded tied) one read overwrote the other between its
read and its checksum, and a sound checkpoint was reported corrupt (and ``restore`` went on to
older ones). :func:`shared_destinations` tells the loader, before it reads, which tensors to
skip (the same memory as one read before it, with the same bytes in the checkpoint: a tie
saved as such, read once) and which to read into a staging tensor and copy in after every
read, one at a time in path order (the last one wins, as in ``Module.load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .buffers import in_place
from .dtensor import local_part, shard_of
from .manifest import TensorEntry
from .planner import Box


def shared_destinations(
    order: list[str], live: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, TensorEntry], src: Any = None
) -> tuple[set[str], set[str], list[tuple[str, str]]]:
    """``(skip, stage, differ)`` for the tensors ``order`` (plan order: the paths of ``live``)
    read into their live destinations ``live[path].get(path)``; ``differ`` lists ``(first, later)`` pairs that are
    one tensor in the state but hold different bytes in the checkpoint (the later one wins).
    Destinations read through a staging tensor anyway (GPU, non-contiguous, another dtype) are
    copied in one at a time after the reads and cannot race: they are never skipped or staged;
    a destination read in place after one of them in plan order is staged (its copy follows).
    Memory is shared only within one storage: first the storage of each destination (~0.3 us
    a tensor, where a hot load of 10,000 tensors spends ~14 us; no tie and no view, the common
    case, ends there), then the spans of those whose storage holds another destination too.
    ``src`` (the loader's ``index.ChunkSource``) resolves regular (format 2) entries, whose block
    checksums are in the index files, over this rank's box of them (an FSDP2 tie)."""
    bases = [
        t.untyped_storage().data_ptr() if type(t) is torch.Tensor else _base(t)
        for p, dest in live.items()
        if (t := dest.get(p)) is not None
    ]
    skip: set[str] = set()
    stage: set[str] = set()
    differ: list[tuple[str, str]] = []
    if len(set(bases)) == len(bases):
        return skip, stage, differ
    seen: dict[int, int] = {}
    for b in bases:
        seen[b] = seen.get(b, 0) + 1
    pos = {p: i for i, p in enumerate(order)}
    spans: list[tuple[int, int, int]] = []  # (start address, end address, plan position)
    held = ((p, t) for p, dest in live.items() if (t := dest.get(p)) is not None)
    for (p, t), b in zip(held, bases, strict=True):
        if b > 0 and seen[b] > 1 and p in pos and (n := (t := local_part(t)).nbytes):
            spans.append((t.data_ptr(), t.data_ptr() + n, pos[p]))
    if len(spans) < 2:
        return skip, stage, differ
    spans.sort()
    group, end = [spans[0]], spans[0][1]
    for s in spans[1:]:
        if s[0] < end:
            group.append(s)
            end = max(end, s[1])
        else:
            if len(group) > 1:
                _settle(group, order, live, tensors, skip, stage, differ, src)
            group, end = [s], s[1]
    if len(group) > 1:
        _settle(group, order, live, tensors, skip, stage, differ, src)
    return skip, stage, differ


def _settle(
    group: list[tuple[int, int, int]],
    order: list[str],
    live: Mapping[str, Mapping[str, Any]],
    tensors: Mapping[str, TensorEntry],
    skip: set[str],
    stage: set[str],
    differ: list[tuple[str, str]],
    src: Any = None,
) -> None:
    """One run of destinations whose memory overlaps: the first in plan order stays read in
    place (when it can be); each later one that could be is skipped (the same view, the same
    bytes, nothing copied over it in between) or staged. A destination staged anyway is copied
    in after every read: the ones after it are staged too, so that all copies keep plan order."""
    members = []
    for _start, _end, i in sorted(group, key=lambda s: s[2]):
        p = order[i]
        t = local_part(live[p][p])
        members.append((p, t, in_place(t, tensors[p].torch_dtype)))
    (first, ft, first_direct), copied = members[0], False
    for p, t, direct in members[1:]:
        view = t.data_ptr() == ft.data_ptr() and t.shape == ft.shape and t.dtype == ft.dtype and t.stride() == ft.stride()
        same = view and _same_bytes(tensors[first], tensors[p], (src, first, p, live[p][p]) if src is not None else None)
        if view and not same:  # one tensor under two names (a tie), other values in the checkpoint: the later wins
            differ.append((first, p))
        if not direct:
            copied = True  # staged by the loader: copied in after the reads, in plan order
        elif same and first_direct and not copied:
            skip.add(p)
        else:
            stage.add(p)
            copied = True  # copied in after the reads: a later same view must be too, to keep plan order


def _base(t: torch.Tensor) -> int:
    """The storage address of a Parameter's or DTensor's memory; a subclass without storage of
    its own (a ``__torch_dispatch__`` wrapper) counts as unique here (the read refuses it)."""
    try:
        return local_part(t).untyped_storage().data_ptr()
    except RuntimeError:
        return -1 - id(t)



def _same_bytes(a: TensorEntry, b: TensorEntry, read: tuple[Any, str, str, Any] | None = None) -> bool:
    """Whether two manifest entries hold the same bytes (same boxes, same block checksums). A
    regular entry (format 2: an FSDP2 shard) has its chunks in the index files: compared over the
    box of this rank's shard, ``read = (ChunkSource, path of a, path of b, live tensor)``, through
    the index files this rank reads anyway; unknown without it (not the same)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.regular is None and b.regular is None:
        return [(c.offsets, c.sizes, c.checksums) for c in a.chunks] == [(c.offsets, c.sizes, c.checksums) for c in b.chunks]
    if read is None:
        return False
    src, pa, pb, live = read
    data, _shape, offsets, _ = shard_of(live)
    box = Box(tuple(offsets), tuple(data.shape))
    ca, cb = src.chunks(pa, a, box), src.chunks(pb, b, box)
    return bool(ca) and [(c.offsets, c.sizes, c.checksums) for c in ca] == [(c.offsets, c.sizes, c.checksums) for c in cb]
