"""Offline consolidation: a sharded checkpoint becomes a full one (whole tensors, one file).

``consolidate(src, dst)`` runs in one process without a process group (the ``trainguard
consolidate SRC DST`` command calls it). It streams tensor by tensor: each tensor is read
whole from whatever chunks hold it (checksums verified), written at the next aligned offset
of ``data-00000.bin`` with fresh block checksums, and dropped, so memory stays bounded by the
largest tensor. Rank-local entries (RNG, per-rank iterators) are kept per saved rank, and
aliases (format 3: a tie stored once) stay aliases of their target. The manifest is written
last and the directory renamed into place, as in a save.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from . import layout
from .commit import check_file_sizes, commit_dir, occupied, read_manifest
from .errors import CheckpointError, StepExistsError
from .index import ChunkSource, plan_args
from .io import DEFAULT_BLOCK, ReadTarget, read_targets, tensor_bytes
from .manifest import Chunk, Manifest, TensorEntry, checksum
from .planner import full_box, layout_file, plan_reads
from .storage import for_path
from .tied import format_for, resolve_aliases


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> Manifest:
    """Write the checkpoint at ``src`` as a ``layout="full"`` checkpoint at ``dst``.

    ``dst`` is a step directory (``.../step-000000700``) or any new directory. Raises
    ``StepExistsError`` when ``dst`` already holds a checkpoint (unless ``overwrite``),
    ``CorruptCheckpointError`` when a byte of ``src`` fails its checksum. ``progress(path,
    nbytes)`` is called after each tensor. One process, no collective (run it offline, or on one rank).
    """
    try:
        return _consolidate(src, dst, overwrite, progress)
    except OSError as e:  # an I/O error reading src or writing dst: one CheckpointError (the CLI prints one line)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"consolidate {os.fspath(src)} -> {os.fspath(dst)} failed: {type(e).__name__}: {e}") from e


def _consolidate(src: Any, dst: Any, overwrite: bool, progress: Callable[[str, int], None] | None) -> Manifest:
    sstore, sdir = for_path(src)
    dstore, target = for_path(dst)
    m = read_manifest(sstore, sdir)
    # Sizes on disk before any tensor is allocated (as a load checks them).
    source = ChunkSource.of(sstore, sdir, m)
    check_file_sizes(sstore, sdir, m, {f for e in m.tensors.values() if e.alias is None for f in source.files(e)})
    parent, name = os.path.split(target.rstrip("/"))
    final = dstore.join(parent, name)
    why = occupied(dstore, final, overwrite)
    if why.get("exists"):
        raise StepExistsError(f"{final} already holds a checkpoint; pass --overwrite to replace it")
    if why.get("refused"):
        raise CheckpointError(why["refused"])
    dstore.makedirs(parent)
    save_id = uuid.uuid4().hex[:16]
    work = dstore.join(parent, layout.tmp_dir(name, save_id) if dstore.atomic_rename else name)
    fname = layout.data_file(0)
    tensors: dict[str, TensorEntry] = {}
    w = None
    try:  # from here on a failure (an I/O error, Ctrl-C) leaves no temp directory behind
        dstore.makedirs(work)
        w = dstore.open_write(dstore.join(work, fname))
        pos = 0
        for path, e in m.tensors.items():
            if e.alias is not None:
                continue  # given its target's chunks below: the bytes are written once
            whole = _read_whole(sstore, sdir, source, path, e)
            data = tensor_bytes(whole)
            (off,), pos = layout_file([len(data)], pos)
            chunks = []
            if len(data):
                w.pwrite(data, off)
                sums = [checksum(data[b : b + DEFAULT_BLOCK]) for b in range(0, len(data), DEFAULT_BLOCK)]
                chunks.append(Chunk([0] * len(e.shape), list(e.shape), fname, off, len(data), sums))
            tensors[path] = TensorEntry(e.dtype, list(e.shape), chunks)
            if progress:
                progress(path, len(data))
            del whole, data
        w.finish(pos)
        for path, e in m.tensors.items():
            if e.alias is not None:
                tensors[path] = TensorEntry(e.dtype, list(e.shape), [], alias=e.alias)
        tensors = {p: tensors[p] for p in m.tensors}  # the source's order (sorted by path)
        resolve_aliases(tensors, os.fspath(dst))  # each alias gets its target's new chunks
    except BaseException:
        if w is not None:
            w.abort()
        dstore.remove_tree(work)
        raise
    out = Manifest(
        step=m.step,
        world_size=m.world_size,
        created=time.time(),
        layout="full",
        block_size=DEFAULT_BLOCK,
        files={fname: pos},
        objects=m.objects,
        tensors=tensors,
        metadata={**m.metadata, "consolidated_from": {"path": os.fspath(src), "layout": m.layout, "created": m.created}},
        library=m.library,
        torch_version=m.torch_version,
        format_version=format_for(tensors.values()),
    )
    try:
        commit_dir(dstore, parent, name, work, out, overwrite, save_id)
    except BaseException:
        dstore.remove_tree(work)
        raise
    return out


def _read_whole(storage: Any, directory: str, src: ChunkSource, path: str, e: TensorEntry) -> torch.Tensor:
    t = torch.empty(e.shape, dtype=e.torch_dtype)
    box = full_box(e.shape)
    ops = plan_reads(
        plan_args(src.all_chunks(path, e)),
        box,
        e.torch_dtype.itemsize,
        src.m.block_size,
        True,
    )
    read_targets(storage, directory, [ReadTarget(path, t, box, ops)])
    return t
