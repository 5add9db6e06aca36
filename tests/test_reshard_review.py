"""Reshard review: resharding loads against the truth after the planner's scratch changes
(``ReadOp.flat`` for widened row reads, scratch groups for column shards).

Data files are real (``io.write_file`` or ``tg.save``, real checksums, read by ``read_targets``
through ``LocalStorage``); chunk layouts and destination boxes are random tilings of small
tensors, with checksum blocks and ``planner.SCRATCH_BYTES`` made small so that every path
(direct, flat end blocks, scratch windows, cut rows) runs many times per tensor.
"""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainguard as tg
from trainguard import api, planner, reads
from trainguard import io as tg_io
from trainguard.commit import read_manifest
from trainguard.errors import CorruptCheckpointError
from trainguard.index import ChunkSource, plan_args
from trainguard.planner import Box, layout_file, plan_reads
from trainguard.storage import LocalStorage
from trainguard.storage import local as slocal

sys.path.insert(0, os.path.dirname(__file__))
from conftest import evict_page_cache as _evict  # noqa: E402
from dist_helper import run_ranks  # noqa: E402

DTYPES = [torch.uint8, torch.bool, torch.bfloat16, torch.int32, torch.float64, torch.complex64]


def _truth(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes (NaNs included: compared bit for bit), bools 0/1."""
    n, isz = math.prod(shape), torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * isz,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return (raw % 2 if dtype == torch.bool else raw).view(dtype).view(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _cuts(n: int, k: int, rng: random.Random) -> list[tuple[int, int]]:
    if rng.random() < 0.5:  # torch.chunk, as Shard(d)
        c = -(-n // k)
        return [(min(i * c, n), max(0, min(c, n - i * c))) for i in range(k)]
    b = [0, *sorted(rng.randint(0, n) for _ in range(k - 1)), n]
    return [(b[i], b[i + 1] - b[i]) for i in range(k)]


def _tiling(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    """A random partition of the tensor into boxes: Shard(d) on 1-5 ranks, a 2-D grid of
    uneven cuts (Shard(0), Shard(1) on a mesh), or recursive cuts along any dims."""
    nd, kind = len(shape), rng.choice(["shard", "grid", "kd"])
    if kind == "shard":
        d = rng.randrange(nd)
        return [Box(tuple(o if i == d else 0 for i in range(nd)), tuple(s if i == d else n for i, n in enumerate(shape)))
                for o, s in _cuts(shape[d], rng.randint(1, 5), rng)]
    if kind == "grid":
        out = [Box((), ())]
        for d in range(nd):
            cuts = _cuts(shape[d], rng.randint(1, 3), rng)
            out = [Box((*b.offsets, o), (*b.sizes, s)) for b in out for o, s in cuts]
        return out

    def split(box: Box, depth: int) -> list[Box]:
        if depth > 2 or rng.random() < 0.3:
            return [box]
        d, out = rng.randrange(nd), []
        for o, s in _cuts(box.sizes[d], rng.randint(2, 3), rng):
            offs, sizes = list(box.offsets), list(box.sizes)
            offs[d], sizes[d] = offs[d] + o, s
            out += split(Box(tuple(offs), tuple(sizes)), depth + 1)
        return out

    return split(Box((0,) * nd, shape), 0)


def _sub(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


def _write(d: str, full: torch.Tensor, boxes: list[Box], block: int, rng: random.Random) -> list:
    """The boxes' bytes in one or two data files, as ``plan_reads`` takes chunks."""
    files: list[list[Box]] = [[], []]
    for b in boxes:
        files[rng.randrange(2)].append(b)
    chunks = []
    for fi, bs in enumerate(files):
        datas = [_sub(full, b).contiguous() for b in bs]
        sizes = [x.numel() * x.element_size() for x in datas]
        offs, size = layout_file(sizes, start=rng.choice([0, 64]))
        name = f"data-{fi}.bin"
        sums = tg_io.write_file(
            LocalStorage(), os.path.join(d, name), [tg_io.WriteChunk(tg_io.tensor_bytes(x), o) for x, o in zip(datas, offs, strict=True)], size, block=block
        )
        chunks += [(b, name, o, n, s) for b, o, n, s in zip(bs, offs, sizes, sums, strict=True)]
    return sorted(chunks, key=lambda c: c[0].offsets)


def _scenario(seed: int, monkeypatch: pytest.MonkeyPatch) -> tuple:
    rng = random.Random(seed)
    nd = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 30 if nd <= 2 else 7) for _ in range(nd))
    dtype = rng.choice(DTYPES)
    block = rng.choice([16, 64, 256, 4096])
    monkeypatch.setattr(planner, "SCRATCH_BYTES", rng.choice([1, 48, 100, 4 << 20]))
    monkeypatch.setattr(slocal._LocalReader, "piece_bytes", rng.choice([None, block, 3 * block]))
    monkeypatch.setattr(slocal._LocalReader, "hash_sub", rng.choice([None, 24]))
    monkeypatch.setattr(reads, "SMALL_OP", rng.choice([0, 1 << 20]))  # pieces, or scatter groups
    dests = [Box(tuple(0 for _ in shape), shape)] + _tiling(shape, rng)
    for _ in range(2):  # any box
        lo = [rng.randint(0, n) for n in shape]
        dests.append(Box(tuple(lo), tuple(rng.randint(0, n - a) for a, n in zip(lo, shape, strict=True))))
    return rng, shape, dtype, block, [b for b in dests if b.numel]


def _assert_blocks_read_once(ops: list, chunks: list) -> None:
    """Per chunk, no byte is read twice (verified reads: each block once)."""
    for ci in {op.chunk_index for op in ops}:
        spans = sorted((op.offset, op.offset + op.length) for op in ops if op.chunk_index == ci)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (chunks[ci][0], spans)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9), st.booleans())
def test_random_layouts_reshard_bit_for_bit(seed: int, verify: bool) -> None:
    """Saved as one random tiling, read as another (and as random boxes, and whole): every
    destination equals the truth, bit for bit; a verified plan reads no byte of a chunk twice."""
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        rng, shape, dtype, block, dests = _scenario(seed, mp)
        full = _truth(shape, dtype, seed)
        chunks = _write(d, full, [b for b in _tiling(shape, rng) if b.numel], block, rng)
        isz, targets = full.element_size(), []
        for i, box in enumerate(dests):
            out = torch.zeros(box.sizes, dtype=dtype)
            ops = plan_reads(chunks, box, isz, block, verify)
            if verify:
                _assert_blocks_read_once(ops, chunks)
            targets.append(tg_io.ReadTarget(f"t{i}", out, box, ops))
        tg_io.read_targets(LocalStorage(), d, targets, streams=rng.choice([1, 2]))
        for t in targets:
            assert torch.equal(_bits(t.dest), _bits(_sub(full, t.box))), (shape, dtype, block, t.box, [c[0] for c in chunks])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
def test_a_flipped_byte_is_caught_wherever_a_verified_read_meets_it(seed: int) -> None:
    """One bit flipped anywhere in a chunk: a verified read whose bytes include it raises
    CorruptCheckpointError (always when the byte is one of the destination's elements), and a
    read that does not raise gives the truth."""
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        rng, shape, dtype, block, dests = _scenario(seed, mp)
        full = _truth(shape, dtype, seed)
        chunks = _write(d, full, [b for b in _tiling(shape, rng) if b.numel], block, rng)
        cbox, name, foff, length, _ = rng.choice(chunks)
        pos = rng.randrange(length)
        with open(os.path.join(d, name), "r+b") as f:
            f.seek(foff + pos)
            b = f.read(1)
            f.seek(foff + pos)
            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        isz = full.element_size()
        idx, rem = [], pos // isz
        for s in reversed(cbox.sizes):
            idx.append(rem % s)
            rem //= s
        elem = [o + i for o, i in zip(cbox.offsets, reversed(idx), strict=True)]
        for box in dests:
            ops = plan_reads(chunks, box, isz, block, True)
            met = any(op.file == name and op.offset <= foff + pos < op.offset + op.length for op in ops)
            needed = all(o <= i < o + s for i, o, s in zip(elem, box.offsets, box.sizes, strict=True))
            out = torch.zeros(box.sizes, dtype=dtype)
            try:
                tg_io.read_targets(LocalStorage(), d, [tg_io.ReadTarget("t", out, box, ops)], streams=rng.choice([1, 2]))
            except CorruptCheckpointError:
                assert met
                continue
            assert not met and not needed, (shape, dtype, block, box, cbox, pos)
            assert torch.equal(_bits(out), _bits(_sub(full, box)))


def _cols(shape: tuple[int, int], n: int, r: int) -> Box:
    c = -(-shape[1] // n)
    lo = min(r * c, shape[1])
    return Box((0, lo), (shape[0], max(0, min(c, shape[1] - lo))))


@pytest.mark.parametrize(("shape", "itemsize", "w", "w2"), [((4096, 11008), 2, 1, 2), ((4096, 11008), 2, 2, 3), ((5120, 13824), 2, 4, 8), ((8192, 4097), 4, 2, 3)])
def test_column_shard_read_reads_each_checksum_block_once(shape: tuple[int, int], itemsize: int, w: int, w2: int) -> None:
    """Tensor-parallel row-wise weights (Llama's w2: 4096 x 11008 bf16, 22,016-byte rows) saved
    Shard(1) on W ranks, read Shard(1) on W' with 4 MiB checksum blocks. The rows do not divide
    a block, so groups of whole rows met the same block at each end: the groups' widened reads
    overlapped and 1.5-2x the bytes were read and hashed (1 -> 2 ranks: 340 MiB for 172 MiB of
    blocks). Now every block of the widened span is read once, in 4 MiB of scratch at a time."""
    block = 4 << 20
    chunks = []
    for r in range(w):
        b = _cols(shape, w, r)
        n = b.numel * itemsize
        chunks.append((b, f"data-{r:05d}.bin", 4096, n, ["0" * 16] * -(-n // block)))
    for r2 in range(w2):
        dest = _cols(shape, w2, r2)
        ops = plan_reads(chunks, dest, itemsize, block, True)
        _assert_blocks_read_once(ops, chunks)
        for ci, (cbox, _f, _o, length, _s) in enumerate(chunks):
            inter = cbox.intersect(dest)
            if inter is None:
                continue
            first, last = inter.flat_start_in(cbox) * itemsize, (planner._last_flat(inter, cbox) + 1) * itemsize
            span = min(-(-last // block) * block, length) - first // block * block
            assert sum(op.length for op in ops if op.chunk_index == ci) == span
        assert all(op.length <= planner.SCRATCH_BYTES for op in ops if op.dest_byte is None)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
@pytest.mark.parametrize("cold", [False, True])
def test_saved_tensor_read_as_column_and_row_boxes_hot_and_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool) -> None:
    """tg.save with 64 KiB blocks, then the loader's plan and reads of boxes of it: a column band
    (scratch windows cutting rows of 4,124 bytes), rows not on a block (flat end blocks and a
    direct middle); cold: whole pages through O_DIRECT. Then one flipped byte in each region
    (the first end block, the direct middle, the last end block, a cut row) is caught."""
    monkeypatch.setattr(api, "DEFAULT_BLOCK", 64 << 10)
    monkeypatch.setattr(planner, "SCRATCH_BYTES", 1 << 20)
    full = _truth((1500, 1031), torch.float32, 5)  # 6.2 MB
    tg.save(tmp_path / "c", {"w": full})
    storage, d = LocalStorage(), str(tmp_path / "c")
    m = read_manifest(storage, d)
    e = m.tensors["w"]
    boxes = [Box((0, 300), (1500, 400)), Box((101, 0), (1203, 1031))]

    def read(box: Box) -> torch.Tensor:
        ops = plan_reads(plan_args(ChunkSource.of(storage, d, m).chunks("w", e, box)), box, 4, m.block_size, True)
        out = torch.zeros(box.sizes)
        if cold:
            _evict(tmp_path / "c")
        tg_io.read_targets(storage, d, [tg_io.ReadTarget("w", out, box, ops)])
        return out

    for box in boxes:
        assert torch.equal(_bits(read(box)), _bits(_sub(full, box)))
    c = e.chunks[0]
    rows_lo, rows_hi = 101 * 1031 * 4, (101 + 1203) * 1031 * 4
    for box, at in [(boxes[1], rows_lo + 5), (boxes[1], rows_lo + 3 * (64 << 10)), (boxes[1], rows_hi - 9), (boxes[0], 1000 * 1031 * 4 + 700 * 4)]:
        with open(tmp_path / "c" / c.file, "r+b") as f:
            f.seek(c.offset + at)
            b = f.read(1)
            f.seek(c.offset + at)
            f.write(bytes([b[0] ^ 0x08]))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            read(box)
        with open(tmp_path / "c" / c.file, "r+b") as f:
            f.seek(c.offset + at)
            f.write(b)


def _ranks_group(rank: int, world: int, root: str, phase: int) -> list[str]:
    """Save (phase 0) or load (phase 1) three DTensors; the load's placements differ."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    api.DEFAULT_BLOCK = 256
    planner.SCRATCH_BYTES = 700
    mesh = init_device_mesh("cpu", (world,))
    specs = [("a", (37, 29), torch.bfloat16, [Shard(0)], [Shard(1)]), ("b", (23, 41), torch.float32, [Shard(1)], [Shard(0)]),
             ("c", (9, 5, 13), torch.complex64, [Shard(1)], [Shard(2)]), ("d", (31, 7), torch.int64, [Replicate()], [Shard(1)])]
    state = {n: distribute_tensor(_truth(s, dt, i) if phase == 0 else torch.zeros(s, dtype=dt), mesh, p[phase])
             for i, (n, s, dt, *p) in enumerate(specs)}
    if phase == 0:
        tg.save(root, state)
        return []
    bad = []
    for verify in (True, False):
        tg.load(root, state, verify=verify)
        bad += [n for i, (n, s, dt, *_p) in enumerate(specs) if not torch.equal(_bits(state[n].full_tensor()), _bits(_truth(s, dt, i)))]
    return bad


def test_dtensors_saved_on_2_ranks_load_on_3_with_other_placements(tmp_path: Path) -> None:
    """Real gloo ranks: Shard(0) saved, Shard(1) loaded and the reverse, a 3-D complex tensor
    between dims 1 and 2, replicated to Shard(1); 256-byte blocks, verified and not: the
    loaded values equal the truth. Then a load of the whole state on one process."""
    run_ranks(_ranks_group, 2, str(tmp_path / "c"), 0, timeout=120)
    res = run_ranks(_ranks_group, 3, str(tmp_path / "c"), 1, timeout=120)
    assert [r.value for r in res] == [[], [], []]
    whole = {"a": torch.zeros(37, 29, dtype=torch.bfloat16), "b": torch.zeros(23, 41), "c": torch.zeros(9, 5, 13, dtype=torch.complex64),
             "d": torch.zeros(31, 7, dtype=torch.int64)}
    tg.load(tmp_path / "c", whole)
    assert all(torch.equal(_bits(whole[n]), _bits(_truth(tuple(t.shape), t.dtype, i))) for i, (n, t) in enumerate(whole.items()))
