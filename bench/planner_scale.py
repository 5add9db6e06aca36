"""Scale on paper: the pure planner and the manifest at 4,096 simulated ranks x 2,000 tensors.

``python -m bench.planner_scale [--ranks 4096] [--tensors 2000] [--layouts ddp,hsdp,fsdp]``

No processes, no I/O: it runs what every rank runs (the replicated assignment, the file layout
of its chunks), what rank 0 runs (the manifest from every rank's report, serialised), what a
loader runs (parse + validate the manifest) and what one rank runs to load at another world
size (the read plan for every tensor). Layouts:

* ``ddp``  every tensor replicated: spread over the ranks, written once (~2,000 chunks);
* ``hsdp`` sharded over 8 ranks, replicated over the 512 groups (16,000 chunks);
* ``fsdp`` sharded over all ranks (8.2 M chunks): the planner, and the manifest extrapolated.

Prints one line per phase with its wall time; first repetitions are reported as measured.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from typing import Any

from trainguard.manifest import Chunk, Manifest, TensorEntry, parse
from trainguard.planner import (
    Box,
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
    print(f"  {name:<44} {time.perf_counter() - t0:7.3f} s")
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


def run(ranks: int, tensors: int, layout: str) -> None:
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
        print(f"  {'chunks':<44} {nchunks:>9}; manifest ~{len(data) * k / 1e6:.0f} MB (extrapolated x{k})")
        timed(f"read plan, one rank at {ranks // 2} ranks (1/{k})", lambda: read_plan(m, 1, ranks // 2, True))
        return
    m = timed("manifest from every rank's report (rank 0)", lambda: manifest_of(per_rank, shp, ranks))
    data = timed("manifest to JSON", m.to_bytes)
    m2 = timed("manifest parse + validate (load)", lambda: parse(data))
    print(f"  {'chunks':<44} {nchunks:>9}; manifest {len(data) / 1e6:.1f} MB")
    sharded = group != 0
    for w in (ranks // 2, ranks * 3 // 4):
        ops = timed(f"read plan, one rank at {w} ranks", lambda w=w: read_plan(m2, 1, w, sharded))
        print(f"  {'  ops':<44} {ops:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--layouts", default="ddp,hsdp,fsdp")
    a = ap.parse_args()
    for layout in a.layouts.split(","):
        run(a.ranks, a.tensors, layout)


if __name__ == "__main__":
    main()
