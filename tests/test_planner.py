"""The pure planner with simulated ranks: replicated balance, read plans for resharding."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.planner import (
    SPLIT_BYTES,
    Box,
    ReplicatedItem,
    assign_replicated,
    full_box,
    overlapping,
    plan_reads,
)

ROOT = Path(__file__).resolve().parent.parent


def shard_box(shape: tuple[int, ...], n: int, r: int, dim: int = 0) -> Box:
    step = -(-shape[dim] // n)
    lo = min(r * step, shape[dim])
    hi = min(lo + step, shape[dim])
    offs = [0] * len(shape)
    sizes = list(shape)
    offs[dim], sizes[dim] = lo, hi - lo
    return Box(tuple(offs), tuple(sizes))


def test_replicated_written_once_and_balanced() -> None:
    items = [ReplicatedItem(f"t{i}", (64 + i, 32), 4) for i in range(40)]
    items.append(ReplicatedItem("big", (200_000, 1000), 4))  # 800 MB: split into row ranges
    out = assign_replicated(items, 8)
    assert out == assign_replicated(list(reversed(items)), 8)  # same answer on every rank
    covered: dict[str, int] = {}
    loads = [0] * 8
    for path, box, r in out:
        covered[path] = covered.get(path, 0) + box.numel
        loads[r] += box.numel * 4
    assert covered == {it.path: math.prod(it.shape) for it in items}  # each element once
    biggest = max(b.numel * 4 for _, b, _ in out)
    assert biggest <= SPLIT_BYTES and max(loads) - min(loads) <= biggest
    assert len([p for p, _, _ in out if p == "big"]) > 8  # the big one is shared by all ranks


def test_replicated_respects_what_ranks_already_write() -> None:
    items = [ReplicatedItem(f"t{i}", (1000,), 4) for i in range(8)]
    out = assign_replicated(items, 2, base_load=[8000, 0])  # rank 0 already writes 8 KB of shards
    assert [r for _, _, r in out].count(1) == 5  # 8000 + 3 x 4000 == 5 x 4000


def _brute(boxes: list[tuple[list[int], list[int]]], dest: Box) -> list[int]:
    return [i for i, (o, s) in enumerate(boxes) if Box(tuple(o), tuple(s)).intersect(dest) is not None]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9), st.data())
def test_overlapping_matches_brute_force(rows: int, w: int, w2: int, data: st.DataObject) -> None:
    shape = (rows, 3)
    boxes = [shard_box(shape, w, r) for r in range(w)]
    raw = [(list(b.offsets), list(b.sizes)) for b in boxes if b.numel]
    r2 = data.draw(st.integers(0, w2 - 1))
    dest = shard_box(shape, w2, r2)
    if dest.numel == 0:
        return
    want = _brute(raw, dest)
    assert overlapping(raw, dest) == want
    shuffled = list(reversed(raw))
    assert sorted(shuffled[i] for i in overlapping(shuffled, dest)) == sorted(raw[i] for i in want)


def _chunks(shape: tuple[int, ...], w: int, dim: int, itemsize: int) -> list:
    out = []
    for r in range(w):
        b = shard_box(shape, w, r, dim)
        if b.numel:
            n = b.numel * itemsize
            out.append((b, f"data-{r:05d}.bin", 4096, n, ["0" * 16] * -(-n // 1024)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 7), st.integers(1, 5), st.integers(1, 5), st.integers(0, 1))
def test_reshard_reads_exactly_the_destination(rows: int, cols: int, w: int, w2: int, dim: int) -> None:
    shape = (rows, cols)
    chunks = _chunks(shape, w, dim, 4)
    total = 0
    for r2 in range(w2):
        dest = shard_box(shape, w2, r2, dim)
        if dest.numel == 0:
            continue
        ops = plan_reads(chunks, dest, 4, 1024, verify=False)
        assert sum(op.inter.numel for op in ops) == dest.numel  # filled exactly once
        read = sum(op.length for op in ops)
        assert read >= dest.numel * 4
        if dim == 0:
            assert read == dest.numel * 4  # rows: contiguous, no byte more than needed
            assert all(op.dest_byte is not None for op in ops)
        total += read
        verified = plan_reads(chunks, dest, 4, 1024, verify=True)
        assert all(op.length <= c[3] for op in verified for c in [chunks[op.chunk_index]])
    assert dim == 1 or total == rows * cols * 4  # the ranks together read the tensor once


def test_whole_tensor_from_row_chunks() -> None:
    shape = (10, 4)
    chunks = _chunks(shape, 3, 0, 2)
    ops = plan_reads(chunks, full_box(shape), 2, 1 << 20, verify=True)
    assert len(ops) == 3 and sum(op.length for op in ops) == 80


def test_scale_benchmark_runs_small(monkeypatch, capsys) -> None:
    """bench/planner_scale.py stays runnable (its real size is run by hand, not in tests). Its
    ``main`` with the command line's arguments, in this process: the work is pure Python, and a
    child interpreter spent nearly all of its time importing torch."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["planner_scale", "--ranks", "16", "--tensors", "30"])
    from bench import planner_scale

    planner_scale.main()
    out = capsys.readouterr().out
    assert "read plan" in out and "manifest parse" in out


class _OtherBox(Box):
    """A Box that never compares equal to a plain one: forces plan_reads' general path."""


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=0, max_size=3),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([16, 64, 100, 4096]),
    st.integers(0, 1 << 20),
    st.booleans(),
)
def test_whole_chunk_fast_path_plans_what_the_general_path_plans(
    shape: list[int], itemsize: int, block: int, foff: int, verify: bool
) -> None:
    """plan_reads' shortcut for a chunk that is exactly the destination (every whole-tensor load)
    gives the same op, field by field, as the box arithmetic it skips."""
    box = full_box(shape)
    length = math.prod(shape) * itemsize
    sums = [f"{b:016x}" for b in range(-(-length // block))]
    fast = plan_reads([(box, "f", foff, length, sums)], box, itemsize, block, verify)
    other = _OtherBox(box.offsets, box.sizes)
    slow = plan_reads([(other, "f", foff, length, sums)], box, itemsize, block, verify)
    assert len(fast) == len(slow) == 1
    assert fast[0] == dataclasses.replace(slow[0], chunk=box, inter=Box(slow[0].inter.offsets, slow[0].inter.sizes))
    assert fast[0].dest_byte == 0 and fast[0].length == length
    if verify:
        assert [c.checksum for c in fast[0].checks] == sums
