"""Whether a tensor's chunks cover it exactly once: ``tiles`` (each load checks a manifest's
chunks with it, ``manifest``) and ``check_cover`` (rank 0 before it commits a save, ``api``).
Pure arithmetic on ``(offsets, sizes)`` boxes; moved out of ``planner`` (re-exported there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Box tilings with at most this many dimensions split are checked by their corners (2**k per box).
CORNER_DIMS = 6


def tiles(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], shape: Sequence[int]) -> bool | None:
    """Whether the non-empty ``(offsets, sizes)`` boxes, each inside ``shape``, cover every element
    of ``shape`` exactly once; None when that cannot be told in time linear in the boxes.

    O(boxes * 2**k), k the number of dimensions that some box does not span whole: the sum of
    the boxes' indicator functions is a signed sum of orthants, one per corner (in each dimension
    ``1[a <= x < b] = H(x - a) - H(x - b)``), and orthants are linearly independent, so the boxes
    tile the tensor iff their signed corners add up to the tensor's. (Comparing boxes pairwise
    took O(boxes**2) for a staircase of long chunks: 25 s for a 575 KB manifest.) Over
    ``CORNER_DIMS`` split dimensions (never written by a save), a sweep with a budget."""
    if not boxes:
        return math.prod(shape) == 0
    split = [d for d, n in enumerate(shape) if any(o[d] or s[d] != n for o, s in boxes)]
    if len(split) > CORNER_DIMS:
        return _sweep(boxes, 256 * len(boxes) + 65536)
    acc: dict[tuple[int, ...], int] = {}
    for o, s in boxes:
        for corner, sign in _corners([(o[d], o[d] + s[d]) for d in split]):
            acc[corner] = acc.get(corner, 0) + sign
    return {c: v for c, v in acc.items() if v} == dict(_corners([(0, shape[d]) for d in split]))


def _corners(spans: list[tuple[int, int]]) -> list[tuple[tuple[int, ...], int]]:
    """The corners of the box with these ``(lo, hi)`` spans, each with its sign (-1 per ``hi``)."""
    out: list[tuple[tuple[int, ...], int]] = [((), 1)]
    for lo, hi in spans:
        out = [(c + (lo,), v) for c, v in out] + [(c + (hi,), -v) for c, v in out]
    return out


def _sweep(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], budget: int) -> bool | None:
    """Whether boxes (whose volumes add up to the tensor's) are pairwise disjoint, comparing the
    pairs that overlap along the dimension with the most distinct offsets; None past ``budget``."""
    d = max(range(len(boxes[0][0])), key=lambda i: len({o[i] for o, _s in boxes}))
    order = sorted(boxes, key=lambda b: b[0][d])
    for i, (ao, asz) in enumerate(order):
        end = ao[d] + asz[d]
        for j in range(i + 1, len(order)):
            bo, bsz = order[j]
            if bo[d] >= end:
                break
            budget -= 1
            if budget < 0:
                return None
            if all(b < a + n and a < b + m for a, n, b, m in zip(ao, asz, bo, bsz, strict=True)):
                return False
    return True


def check_cover(tensors: dict[str, Any]) -> None:
    """Rank 0, before it commits a save (``api._build_manifest``): the chunks the ranks wrote
    cover each tensor's elements exactly once, as every load checks (``manifest``), so that no
    checkpoint is committed that no load accepts. Two ranks that both wrote a part (a DTensor
    held by several device meshes that are not slices of one mesh) fail the save, naming them.
    O(chunks): element counts only; regular (format 2) and alias entries have no chunks here."""
    from .errors import CheckpointError

    for path, e in tensors.items():
        if e.regular is not None or e.alias is not None:
            continue
        chunks = e.chunks  # mostly one (10,000 small tensors): no generator then
        volume = math.prod(chunks[0].sizes) if len(chunks) == 1 else sum(math.prod(c.sizes) for c in chunks)
        n = math.prod(e.shape)
        if volume == n:
            continue
        seen: dict[tuple, str] = {}
        twice = ""
        for c in e.chunks:
            k = (tuple(c.offsets), tuple(c.sizes))
            if k in seen:
                twice = f" ({seen[k]} and {c.file} both hold the part at {list(c.offsets)})"
                break
            seen[k] = c.file
        raise CheckpointError(
            f"{path}: the ranks wrote {volume} elements of its {n}{twice}"
            + "; e.g. a DTensor held by several device meshes is written by each: build them as slices of one "
            "mesh (init_device_mesh(...)['tp']), whose other dimensions count as replicas"
        )
