"""The limit: the state's bytes written and read with no serialization, and memcpy.

``raw_1`` / ``raw_2``: the concatenated bytes of all tensors (key order) are cut into
``world * streams`` equal files; rank r writes files ``r*streams ..`` with ``streams`` threads,
each issuing ``os.writev`` calls of up to 64 MiB (<= 1024 iovecs) straight from memoryviews of
the tensors, then fsync. Loading: every rank ``os.preadv``s every file straight into its own
tensors' memory (files spread over ``streams`` threads). No header, no checksum, no copy.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .base import Ctx, LoadVariant, SyncMethod
from .states import State

_BATCH = 64 << 20
_IOV_MAX = 1024

Batch = list[memoryview]


def _byte_views(state: State) -> list[memoryview]:
    return [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in state.values()]


def _split(views: list[memoryview], parts: int) -> list[list[Batch]]:
    """Cut the concatenated bytes into ``parts`` near-equal files, each a list of batches."""
    total = sum(v.nbytes for v in views)
    bounds = [total * (i + 1) // parts for i in range(parts)]
    files: list[list[Batch]] = [[] for _ in range(parts)]
    pos, part, batch, batch_bytes = 0, 0, [], 0
    for v in views:
        off = 0
        while off < v.nbytes:
            take = min(v.nbytes - off, bounds[part] - pos, _BATCH - batch_bytes)
            batch.append(v[off:off + take])
            off, pos, batch_bytes = off + take, pos + take, batch_bytes + take
            if batch_bytes >= _BATCH or len(batch) >= _IOV_MAX or pos == bounds[part]:
                files[part].append(batch)
                batch, batch_bytes = [], 0
            if pos == bounds[part] and part < parts - 1:
                part += 1
    if batch:
        files[part].append(batch)
    return files


def _plan(ctx: Ctx, state: State, streams: int) -> list[list[Batch]]:
    key = f"raw_plan:{id(state)}:{streams}"
    if key not in ctx.cache:
        ctx.cache[key] = _split(_byte_views(state), ctx.world * streams)
    return ctx.cache[key]


def _advance(bufs: Batch, n: int) -> Batch:
    """The part of ``bufs`` not yet transferred after a short read/write of ``n`` bytes."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:]] + bufs[1:]
    return bufs


def _write_file(path: Path, batches: list[Batch]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for batch in batches:
            bufs = batch
            while bufs:
                bufs = _advance(bufs, os.writev(fd, bufs))
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: Path, batches: list[Batch]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for batch in batches:
            bufs = batch
            while bufs:
                n = os.preadv(fd, bufs, off)
                if n == 0:
                    raise EOFError(f"{path} is shorter than the state")
                off += n
                bufs = _advance(bufs, n)
    finally:
        os.close(fd)


def _run(jobs: list[tuple[Path, list[Batch]]], fn, threads: int) -> None:
    if threads == 1:
        for p, b in jobs:
            fn(p, b)
        return
    with ThreadPoolExecutor(max_workers=threads) as ex:
        groups = [jobs[i::threads] for i in range(threads)]
        futures = [ex.submit(lambda g=g: [fn(p, b) for p, b in g]) for g in groups]
        for f in futures:
            f.result()


def _save(streams: int):
    def save(ctx: Ctx, d: Path, state: State) -> None:
        files = _plan(ctx, state, streams)
        mine = range(ctx.rank * streams, (ctx.rank + 1) * streams)
        _run([(d / f"raw-{i:03d}.bin", files[i]) for i in mine], _write_file, streams)
    return save


def _load(streams: int):
    def load(ctx: Ctx, d: Path, state: State) -> None:
        files = _plan(ctx, state, streams)
        _run([(d / f"raw-{i:03d}.bin", b) for i, b in enumerate(files)], _read_file, streams)
    return load


def _raw(streams: int) -> SyncMethod:
    return SyncMethod(
        name=f"raw_{streams}",
        label=f"limit: raw {streams} stream{'s' if streams > 1 else ''}",
        save=_save(streams),
        loads=(LoadVariant("preadv", _load(streams), True,
                           f"os.preadv straight into the existing tensors, {streams} thread(s)"),),
        how=f"os.writev of <=64 MiB from memoryviews of the tensors, {streams} file(s)/thread(s) "
            "per rank, fsync per file",
        multi_rank=f"each rank writes 1/world of the bytes ({streams} stream(s)); every rank reads all",
        limit=True,
    )


RAW_1 = _raw(1)
RAW_2 = _raw(2)

# ------------------------------------------------------------------ raw with O_DIRECT

_PAGE = 4096


def _direct_plan(ctx: Ctx, state: State) -> list[list[tuple[str, memoryview, int]]]:
    """Two files per rank of (key, bytes, offset): tensors balanced by size, each placed at an
    offset that agrees with its memory address modulo a page (whole pages go O_DIRECT)."""
    key = f"rawd_plan:{id(state)}"
    if key not in ctx.cache:
        import numpy as np

        views = [(k, v) for k, v in zip(state, _byte_views(state)) if v.nbytes]
        mine = views[ctx.rank :: ctx.world]
        files: list[list[tuple[str, memoryview, int]]] = [[], []]
        ends = [0, 0]
        for k, v in sorted(mine, key=lambda kv: -kv[1].nbytes):
            f = 0 if ends[0] <= ends[1] else 1
            phase = int(np.frombuffer(v, dtype=np.uint8).ctypes.data) % _PAGE
            off = ends[f] + (phase - ends[f]) % _PAGE
            files[f].append((k, v, off))
            ends[f] = off + v.nbytes
        ctx.cache[key] = files
    return ctx.cache[key]


def _write_direct(path: Path, items: list[tuple[str, memoryview, int]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        for _k, v, off in items:
            head = min(-off % _PAGE, v.nbytes)
            mid = (v.nbytes - head) // _PAGE * _PAGE
            parts = [(fd, v[:head], off)]
            parts += [(dfd, v[head + a : head + min(a + _BATCH, mid)], off + head + a) for a in range(0, mid, _BATCH)]
            parts.append((fd, v[head + mid :], off + head + mid))
            for f, b, o in parts:
                while b.nbytes:
                    n = os.pwrite(f, b, o)
                    b, o = b[n:], o + n
        os.fsync(fd)
    finally:
        os.close(dfd)
        os.close(fd)


def _read_direct_layout(path: Path, items: list[tuple[str, memoryview, int]]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for _k, v, off in items:
            b, o = v, off
            while b.nbytes:
                n = os.preadv(fd, [b], o)
                if n == 0:
                    raise EOFError(f"{path} is shorter than the state")
                b, o = b[n:], o + n
    finally:
        os.close(fd)


def _save_direct(ctx: Ctx, d: Path, state: State) -> None:
    files = _direct_plan(ctx, state)
    _run([(d / f"rawd-{ctx.rank:03d}-{i}.bin", items) for i, items in enumerate(files)], _write_direct, 2)
    # Where each tensor went (offsets depend on this process's addresses): for the readers.
    layout = [[(k, off) for k, _v, off in items] for items in files]
    (d / f"rawd-{ctx.rank:03d}.json").write_text(json.dumps(layout))


def _load_direct(ctx: Ctx, d: Path, state: State) -> None:
    views = dict(zip(state, _byte_views(state)))
    jobs = []
    for r in range(ctx.world):  # every rank reads every rank's files, like raw_N
        layout = json.loads((d / f"rawd-{r:03d}.json").read_text())
        jobs += [(d / f"rawd-{r:03d}-{i}.bin", [(k, views[k], off) for k, off in items]) for i, items in enumerate(layout)]
    _run(jobs, _read_direct_layout, 2)


RAW_D2 = SyncMethod(
    name="raw_d2",
    label="limit: raw 2 streams, O_DIRECT",
    save=_save_direct,
    loads=(LoadVariant("preadv", _load_direct, True, "os.preadv straight into the existing tensors, 2 threads"),),
    how="each tensor at a file offset that agrees with its address modulo 4 KiB; its whole pages "
        "written with O_DIRECT (<= 64 MiB per pwrite), the bytes around them buffered; 2 files/threads "
        "per rank, fsync per file",
    multi_rank="each rank writes every world-th tensor (2 files); every rank reads all",
    limit=True,
)


def memcpy_dest(state: State) -> State:
    """Destination tensors for the memcpy measurement, allocated and touched (untimed)."""
    dest = {k: torch.empty_like(t) for k, t in state.items()}
    memcpy(state, dest)
    return dest


def memcpy(state: State, dest: State) -> None:
    with torch.no_grad():
        for k, t in state.items():
            dest[k].copy_(t)
