"""Boxes: the n-d index ranges every plan is made of (``Box``, ``full_box``), and ``Regular``, a tensor split
into equal parts along one dim (``torch.chunk``/``Shard(dim)``).

Moved out of ``planner.py``, which imports and re-exports every name here (most callers import them from
there): the save's capture (``capture``), the write plan and read plan (``planner``), the manifest and its
index (``manifest``, ``index``) and the load's copies (``io``) build and intersect them; any rank, any thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and self.sizes:
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def flat_start_in(self, outer: Box) -> int:
        """Row-major element index of this box's first element inside ``outer``."""
        idx = 0
        for o, oo, s in zip(self.offsets, outer.offsets, outer.sizes, strict=True):
            idx = idx * s + (o - oo)
        return idx

    def is_contiguous_in(self, outer: Box) -> bool:
        """True when this box's elements form one contiguous run in ``outer`` (row-major)."""
        diff = [i for i, (a, b) in enumerate(zip(self.sizes, outer.sizes, strict=True)) if a != b]
        if not diff:
            return True
        return all(self.sizes[j] == 1 for j in range(diff[-1]))


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous (row-major) array of ``sizes``."""
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


_FULL: dict[tuple[int, ...], Box] = {}  # shape -> its whole box, shared (a Box is immutable)


def full_box(shape: Sequence[int]) -> Box:
    """A whole tensor's box, one object per shape (at most 65,536 kept): a new one per tensor kept
    alive by an async save would count towards the interpreter's next full garbage collection."""
    if (box := _FULL.get(key := tuple(shape))) is None:
        box = _FULL[key] = Box((0,) * len(key), key)
        if len(_FULL) > 65_536:
            _FULL.clear()
    return box


@dataclass(frozen=True)
class Regular:
    """A tensor split into ``parts`` along ``dim`` with ``torch.chunk`` / DTensor ``Shard(dim)``
    semantics: chunk size ``c = ceil(n / parts)``; part ``i`` starts at ``min(i*c, n)`` and
    holds ``max(0, min(c, n - i*c))`` rows (as ``compute_local_shape_and_global_offset``)."""

    dim: int
    parts: int

    def chunk(self, shape: Sequence[int]) -> int:
        return -(-shape[self.dim] // self.parts)

    def part_box(self, shape: Sequence[int], i: int) -> Box:
        n, c = shape[self.dim], self.chunk(shape)
        lo = min(i * c, n)
        offs = [0] * len(shape)
        sizes = list(shape)
        offs[self.dim], sizes[self.dim] = lo, max(0, min(c, n - lo))
        return Box(tuple(offs), tuple(sizes))

    def nonempty(self, shape: Sequence[int]) -> int:
        """How many leading parts hold at least one row along ``dim`` (the rest are empty)."""
        c = self.chunk(shape)
        return min(self.parts, -(-shape[self.dim] // c)) if c else 0

    def overlapping(self, shape: Sequence[int], dest: Box) -> range:
        """The parts whose boxes meet ``dest`` along ``dim``: O(1), no scan of the parts."""
        c = self.chunk(shape)
        lo, hi = dest.offsets[self.dim], dest.offsets[self.dim] + dest.sizes[self.dim]
        if not c or hi <= lo:
            return range(0)
        return range(lo // c, min(self.nonempty(shape), -(-hi // c)))
