"""Scale on paper: the pure planner and the manifest at 4,096 simulated ranks x 2,000 tensors.

``python -m bench.planner_scale [--ranks 4096] [--tensors 2000] [--layouts ddp,hsdp,fsdp-v2,fsdp]``

No processes, no I/O: it runs what every rank runs (the replicated assignment, the file layout
of its chunks), what rank 0 runs (the manifest from every rank's report, serialised), what a
loader runs (parse + validate the manifest) and what one rank runs to load at another world
size (the read plan for every tensor). Layouts:

* ``ddp``  every tensor replicated: spread over the ranks, written once (~2,000 chunks);
* ``hsdp`` sharded over 8 ranks, replicated over the 512 groups (16,000 chunks);
* ``fsdp-v2`` sharded over all ranks in format 2's regular form (what FSDP2 saves): a rule per
  tensor in the manifest, one index file per rank; measured in full, no extrapolation;
* ``fsdp`` the same sharding as explicit format 1 chunks (8.1 M chunks): the manifest is
  extrapolated from 1/64 of the tensors (30-160 s; not in the default set).

Prints one line per phase with its wall time; first repetitions are reported as measured.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from typing import Any

from trainguard.index import ChunkSource, encode, plan_args
from trainguard.layout import data_file, index_file
from trainguard.manifest import Chunk, Manifest, TensorEntry, checksum, parse
from trainguard.planner import (
    Box,
    Regular,
    ReplicatedItem,
    assign_replicated,
    full_box,
    layout_file,
    overlapping,
    plan_reads,
)

BLOCK = 4 << 20
SUM = "0123456789abcdef"


def shapes(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """GPT-like parameter shapes (matrices, vectors, a few embeddings): ~24 G elements for 2,000."""
    rnd = random.Random(seed)
    out: list[tuple[int, ...]] = []
    for i in range(n):
        k = i % 10
        if k < 2:
            out.append((4096, 4096))
        elif k < 4:
            out.append((11008, 4096) if rnd.random() < 0.5 else (4096, 11008))
        elif k == 9 and i % 500 == 9:
            out.append((32000, 4096))
        else:
            out.append((4096,))
    return out


def timed(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    print(f"  {name:<52} {time.perf_counter() - t0:7.3f} s")
    return out


def shard_box(shape: tuple[int, ...], n: int, r: int) -> Box:
    """Rank r's ``torch.chunk``-style dim-0 shard (what DTensor Shard(0) / FSDP2 give)."""
    step = -(-shape[0] // n)
    lo = min(r * step, shape[0])
    hi = min(lo + step, shape[0])
    return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))


def shard_boxes(shape: tuple[int, ...], n: int) -> list[Box]:
    return [shard_box(shape, n, r) for r in range(n)]


def write_plan(ranks: int, shp: list[tuple[int, ...]], group: int) -> dict[int, list[tuple[str, Box]]]:
    """Every rank's chunks. group=0: replicated; else sharded over ``group`` ranks, the first
    group writing (the other replicas are not writers)."""
    per_rank: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(ranks)}
    if group == 0:
        items = [ReplicatedItem(f"model/t{i}", s, 2) for i, s in enumerate(shp)]
        for path, box, r in assign_replicated(items, ranks):
            per_rank[r].append((path, box))
    else:
        for i, s in enumerate(shp):
            for r, b in enumerate(shard_boxes(s, group)):
                if b.numel:
                    per_rank[r].append((f"model/t{i}", b))
    return per_rank


def manifest_of(per_rank: dict[int, list[tuple[str, Box]]], shp: list[tuple[int, ...]], ranks: int) -> Manifest:
    tensors = {f"model/t{i}": TensorEntry("bfloat16", list(s), []) for i, s in enumerate(shp)}
    files = {}
    for r, chunks in per_rank.items():
        offs, size = layout_file([b.numel * 2 for _, b in chunks])
        if chunks:
            files[f"data-{r:05d}.bin"] = size
        for (path, b), off in zip(chunks, offs, strict=True):
            n = b.numel * 2
            tensors[path].chunks.append(
                Chunk(list(b.offsets), list(b.sizes), f"data-{r:05d}.bin", off, n, [SUM] * -(-n // BLOCK))
            )
    return Manifest(step=1, world_size=ranks, created=0.0, layout="sharded", block_size=BLOCK, files=files,
                    objects={"model": {"skeleton": {}}}, tensors=tensors)


def read_plan(m: Manifest, rank: int, new_world: int, sharded: bool) -> int:
    """One rank's read plan for every tensor at ``new_world`` ranks; returns the op count."""
    n = 0
    for e in m.tensors.values():
        shape = tuple(e.shape)
        dest = shard_box(shape, new_world, rank) if sharded else full_box(shape)
        near = [e.chunks[i] for i in overlapping([(c.offsets, c.sizes) for c in e.chunks], dest)]
        chunks = [(Box(tuple(c.offsets), tuple(c.sizes)), c.file, c.offset, c.length, c.checksums) for c in near]
        n += len(plan_reads(chunks, dest, 2, m.block_size, True))
    return n


def rank_index(ranks: int, shp: list[tuple[int, ...]], r: int) -> tuple[bytes, int]:
    """What rank r writes in format 2: its file layout and its index bytes (and the file size)."""
    boxes = [shard_box(s, ranks, r) for s in shp]
    offs, size = layout_file([b.numel * 2 for b in boxes])
    entries = {f"model/t{i}": (o, b.numel * 2, [SUM] * -(-b.numel * 2 // BLOCK)) for i, (b, o) in enumerate(zip(boxes, offs))}
    return encode(data_file(r), entries), size


def run_regular(ranks: int, tensors: int) -> None:
    """FSDP over all ranks, format 2: what one rank writes, what rank 0 commits, what a loader
    parses, and one rank's read plan at another world size, index look-ups included."""
    shp = shapes(tensors)
    print(f"fsdp-v2: {ranks} ranks x {tensors} tensors, regular form (format 2)")
    timed("write plan, one rank (boxes + layout + index)", lambda: rank_index(ranks, shp, 1))
    # Rank 0's gather carries (file size, index size, index checksum) per rank; simulated with
    # rank 1's index for every rank (same size; the checksum only needs to be well formed).
    idx1, size1 = rank_index(ranks, shp, 1)
    reports = [(data_file(r), size1, index_file(r), len(idx1), checksum(idx1)) for r in range(ranks)]

    def commit() -> bytes:
        m = Manifest(step=1, world_size=ranks, created=0.0, layout="sharded", block_size=BLOCK,
                     files={f: size for f, size, *_ in reports}, objects={"model": {"skeleton": {}}},
                     tensors={f"model/t{i}": TensorEntry("bfloat16", list(s), [], Regular(0, ranks)) for i, s in enumerate(shp)},
                     format_version=2, indexes={n: (k, h) for _f, _s, n, k, h in reports})
        return m.to_bytes()

    data = timed("manifest from every rank's report + JSON (rank 0)", commit)
    m = timed("manifest parse + validate (load)", lambda: parse(data))
    print(f"  {'manifest':<52} {len(data) / 1e6:9.2f} MB; {len(m.indexes)} index files of ~{len(idx1) / 1e3:.0f} kB")
    for w in (ranks // 2, ranks * 3 // 4):
        need = sorted({i for e in m.tensors.values() for i in e.regular.overlapping(e.shape, shard_box(tuple(e.shape), w, 1))})
        built = {i: rank_index(ranks, shp, i) for i in need}  # the "disk", built untimed
        files = {index_file(i): b for i, (b, _size) in built.items()}
        # The manifest above signed rank 1's index for every rank: re-sign the ones read here.
        m.indexes.update({n: (len(b), checksum(b)) for n, b in files.items()})
        m.files.update({data_file(i): size for i, (_b, size) in built.items()})

        def plan(w: int = w, files: dict[str, bytes] = files) -> int:
            src = ChunkSource(m, files.__getitem__)
            n = 0
            for p, e in m.tensors.items():
                dest = shard_box(tuple(e.shape), w, 1)
                n += len(plan_reads(plan_args(src.chunks(p, e, dest)), dest, 2, m.block_size, True))
            return n

        ops = timed(f"read plan, one rank at {w} ranks (+ {len(need)} indexes)", plan)
        print(f"  {'  ops':<52} {ops:>9}")


def run(ranks: int, tensors: int, layout: str) -> None:
    if layout == "fsdp-v2":
        run_regular(ranks, tensors)
        return
    shp = shapes(tensors)
    group = {"ddp": 0, "hsdp": 8, "fsdp": ranks}[layout]
    elems = sum(math.prod(s) for s in shp)
    print(f"{layout}: {ranks} ranks x {tensors} tensors ({elems / 1e9:.1f} G elements, bf16)")
    if group == ranks:
        # Every rank plans only its own 2,000 boxes; simulating all 4,096 would time the simulation.
        def own_plan() -> tuple[list[int], int]:
            return layout_file([shard_box(s, ranks, 1).numel * 2 for s in shp])

        timed("write plan, one rank (its boxes + file layout)", own_plan)
        per_rank = write_plan(ranks, shp, group)
    else:
        per_rank = timed("write plan (assignment + every rank's file layout)", lambda: write_plan(ranks, shp, group))
    nchunks = sum(len(c) for c in per_rank.values())
    if nchunks > 1_000_000:
        # Extrapolate the manifest from a 1/64 sample of the tensors (time and size are linear).
        k = 64
        sample = shp[: tensors // k]
        m = manifest_of(write_plan(ranks, sample, group), sample, ranks)
        data = timed(f"manifest to JSON (1/{k} of the tensors)", m.to_bytes)
        timed(f"manifest parse + validate (1/{k})", lambda: parse(data))
        print(f"  {'chunks':<52} {nchunks:>9}; manifest ~{len(data) * k / 1e6:.0f} MB (extrapolated x{k})")
        timed(f"read plan, one rank at {ranks // 2} ranks (1/{k})", lambda: read_plan(m, 1, ranks // 2, True))
        return
    m = timed("manifest from every rank's report (rank 0)", lambda: manifest_of(per_rank, shp, ranks))
    data = timed("manifest to JSON", m.to_bytes)
    m2 = timed("manifest parse + validate (load)", lambda: parse(data))
    print(f"  {'chunks':<52} {nchunks:>9}; manifest {len(data) / 1e6:.1f} MB")
    sharded = group != 0
    for w in (ranks // 2, ranks * 3 // 4):
        ops = timed(f"read plan, one rank at {w} ranks", lambda w=w: read_plan(m2, 1, w, sharded))
        print(f"  {'  ops':<52} {ops:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--layouts", default="ddp,hsdp,fsdp-v2")
    a = ap.parse_args()
    for layout in a.layouts.split(","):
        run(a.ranks, a.tensors, layout)


if __name__ == "__main__":
    main()
