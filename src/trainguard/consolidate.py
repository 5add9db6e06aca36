"""Offline consolidation: a sharded checkpoint becomes a full one (whole tensors, one file).

``consolidate(src, dst)`` runs in one process without a process group (the ``trainguard
consolidate SRC DST`` command calls it). It streams in batches of up to 256 MiB: each tensor
is read whole from whatever chunks hold it (checksums verified; a batch's reads in parallel)
into one reused buffer, then written at its aligned offset of ``data-00000.bin`` with fresh
block checksums (``io.write_batches``: direct I/O on local disks); a tensor larger than a batch
is read and written in pieces of whole checksum blocks, so memory stays bounded by 256 MiB
(before session 51: by the largest tensor, when larger). Rank-local entries (RNG, per-rank iterators) are
kept per saved rank, and aliases (format 3: a tie stored once) stay aliases of their target.
The manifest is written last and the directory renamed into place, as in a save.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import layout
from .buffers import aligned_empty
from .commit import check_file_sizes, commit_dir, occupied, read_manifest
from .errors import CheckpointError, DiskFullError, StepExistsError
from .index import ChunkSource, plan_args
from .io import DEFAULT_BLOCK, ReadTarget, WriteChunk, read_targets, tensor_bytes, write_batches
from .manifest import Chunk, Manifest, TensorEntry
from .outtemp import owned, sweep
from .planner import PAGE, Box, full_box, layout_file, plan_reads
from .storage import for_path
from .storage._diskfull import write_refused
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
    nbytes)`` is called after each tensor is written. One process, no collective (run it offline, or on one rank).
    """
    from .srcnamed import naming_source  # a corrupt src: named, with its earlier steps

    try:
        with naming_source(src):
            return _consolidate(src, dst, overwrite, progress)
    except OSError as e:  # an I/O error reading src or writing dst: one CheckpointError (the CLI prints one line)
        if isinstance(e, CheckpointError):
            raise
        why = write_refused(e) or f"{type(e).__name__}: {e}"  # a read-only destination: what to change, not its temp name
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # creating a file or directory (out of space or inodes), as tg.save
            raise DiskFullError(e.errno, f"consolidate {os.fspath(src)} -> {os.fspath(dst)} failed: no space left on "
                                "device: the file system is out of space or of inodes (`df -h`, `df -i`). Free some, "
                                "or write elsewhere") from e
        raise CheckpointError(f"consolidate {os.fspath(src)} -> {os.fspath(dst)} failed: {why}") from e


def _consolidate(src: Any, dst: Any, overwrite: bool, progress: Callable[[str, int], None] | None) -> Manifest:
    sstore, sdir = for_path(src)
    dstore, target = for_path(dst)
    m = read_manifest(sstore, sdir)
    # Sizes on disk before any tensor is allocated (as a load checks them).
    source = ChunkSource.of(sstore, sdir, m)
    check_file_sizes(sstore, sdir, m, {f for e in m.tensors.values() if e.alias is None for f in source.files(e)})
    parent, name = os.path.split(target.rstrip("/"))
    final = dstore.join(parent, name)
    if (named := layout.parse_step(name)) is not None and named != m.step:  # a load would refuse it (commit.read_manifest)
        raise CheckpointError(f"{final} is named step {named}, and {os.fspath(src)} is the checkpoint of step {m.step}: "
                              f"name the copy {layout.step_dir(m.step)}, or a name that is not a step's")
    paths = [p for p, e in m.tensors.items() if e.alias is None]  # an alias gets its target's chunks below
    items = [(p, m.tensors[p]) for p in paths]

    def batches(offs: list[int], owners: list[int]) -> Iterator[list[WriteChunk]]:
        def written(done: list[int]) -> None:  # write_batches asks for the next batch once one is written
            if progress:
                for i in done:
                    progress(paths[i], items[i][1].nbytes)

        return whole_batches(sstore, sdir, source, items, offs, written=written, owners=owners)

    def manifest(tensors: dict[str, TensorEntry], files: dict[str, int]) -> Manifest:
        for path, e in m.tensors.items():
            if e.alias is not None:
                tensors[path] = TensorEntry(e.dtype, list(e.shape), [], alias=e.alias)
        tensors = {p: tensors[p] for p in m.tensors}  # the source's order (sorted by path)
        resolve_aliases(tensors, os.fspath(dst))  # each alias gets its target's new chunks
        return Manifest(
            step=m.step,
            world_size=m.world_size,
            created=time.time(),
            layout="full",
            block_size=DEFAULT_BLOCK,
            files=files,
            objects=m.objects,
            tensors=tensors,
            metadata={**m.metadata, "consolidated_from": {"path": os.fspath(src), "layout": m.layout, "created": m.created}},
            library=m.library,
            torch_version=m.torch_version,
            format_version=format_for(tensors.values()),
        )

    return write_full(dstore, parent, name, items, batches, manifest, overwrite=overwrite)


def write_full(
    dstore: Any, parent: str, name: str, items: list[tuple[str, TensorEntry]],
    batches: Callable[[list[int], list[int]], Iterator[list[WriteChunk]]],
    manifest: Callable[[dict[str, TensorEntry], dict[str, int]], Manifest], *, overwrite: bool = False,
) -> Manifest:
    """Write tensors ``items`` (``(manifest path, entry)``, whole, in this order) into one data file of a new
    checkpoint ``parent/name``, then commit it: ``consolidate``, and ``convert``'s import of a DCP
    directory (``dcp_stream``). ``batches(offs, owners)`` gives ``io.write_batches``'s batches of
    the tensors at file offsets ``offs`` (``whole_batches``), putting the index of each chunk's
    tensor in ``owners``; ``manifest(tensors, files)`` makes the manifest from the written tensors'
    entries (one chunk each) and the files. Written into a temporary directory (where the storage
    renames), the manifest last, renamed into place (``commit.commit_dir``): a failure or Ctrl-C
    leaves no temporary directory and nothing that looks like a checkpoint; one killed (SIGKILL) leaves its temporary
    directory, which the next ``write_full`` of ``parent/name`` removes (local disk: ``outtemp``). Refuses a ``parent/name``
    that holds a checkpoint (``StepExistsError``; unless ``overwrite``) or other files."""
    final = dstore.join(parent, name)
    if dstore.atomic_rename:  # local disk: killed earlier writers' temp directories go, a checkpoint set aside is back
        sweep(final)
    why = occupied(dstore, final, overwrite)
    if why.get("exists"):
        raise StepExistsError(f"{final} already holds a checkpoint; pass --overwrite to replace it")
    if why.get("refused"):
        raise CheckpointError(why["refused"])
    dstore.makedirs(parent)
    save_id = uuid.uuid4().hex[:16]
    work = dstore.join(parent, layout.tmp_dir(name, save_id) if dstore.atomic_rename else name)
    fname = layout.data_file(0)
    sizes = [e.nbytes for _p, e in items]
    offs, size = layout_file(sizes)
    with owned(work) if dstore.atomic_rename else contextlib.nullcontext():
        try:  # from here on a failure (an I/O error, Ctrl-C) leaves no temp directory behind
            dstore.makedirs(work)
            owners: list[int] = []  # the tensor of each chunk written: a large one's pieces give its checksums
            sums: list[list[str]] = [[] for _ in items]
            for i, s in zip(owners, write_batches(dstore, dstore.join(work, fname), batches(offs, owners), size,
                                                   block=DEFAULT_BLOCK), strict=True):
                sums[i] += s
            tensors = {path: TensorEntry(e.dtype, list(e.shape), [Chunk([0] * len(e.shape), list(e.shape), fname, off, n, s)] if n else [])
                       for (path, e), off, n, s in zip(items, offs, sizes, sums, strict=True)}
            out = manifest(tensors, {fname: size})
            commit_dir(dstore, parent, name, work, out, overwrite, save_id)
        except BaseException:
            dstore.remove_tree(work)
            raise
    return out


GROUP = 256 << 20  # bytes read (in parallel) and then written per batch; a larger tensor in pieces (_pieces)


def _groups(offs: list[int], sizes: list[int]) -> list[list[int]]:
    """Consecutive tensors (indices) whose span in the file, from the page their first starts in,
    is at most ``GROUP`` bytes (a tensor larger than that: alone)."""
    groups: list[list[int]] = []
    for i, (o, n) in enumerate(zip(offs, sizes)):
        if groups and o + n - offs[groups[-1][0]] // PAGE * PAGE <= GROUP:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _pieces(sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(tensor index, byte start in it, length)``: each tensor whole, but one larger than ``GROUP``
    in pieces of ``GROUP`` bytes rounded down to whole checksum blocks (``DEFAULT_BLOCK``: the
    pieces' block checksums, concatenated, are the tensor's), so that memory holds one piece of it."""
    step = max(GROUP // DEFAULT_BLOCK, 1) * DEFAULT_BLOCK
    return [(i, at, min(step, n - at)) if n > GROUP else (i, 0, n)
            for i, n in enumerate(sizes) for at in (range(0, n, step) if n > GROUP else (0,))]


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[Box, int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes, each contiguous in it, with
    the element index each starts at (a partial row, whole rows, a partial row; recursively)."""
    if lo >= hi:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    inner, n = math.prod(shape[1:]), len(shape)
    out: list[tuple[Box, int]] = []
    if lo % inner:  # a partial first row
        r, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        out += [(Box((r, *b.offsets), (1, *b.sizes)), r * inner + at) for b, at in flat_boxes(shape[1:], lo - r * inner, end - r * inner)]
        lo = end
    if hi // inner > lo // inner and lo < hi:  # whole rows
        r0, r1 = lo // inner, hi // inner
        out.append((Box((r0,) + (0,) * (n - 1), (r1 - r0, *shape[1:])), r0 * inner))
        lo = r1 * inner
    if lo < hi:  # a partial last row
        r = lo // inner
        out += [(Box((r, *b.offsets), (1, *b.sizes)), r * inner + at) for b, at in flat_boxes(shape[1:], 0, hi - r * inner)]
    return out


def whole_batches(
    storage: Any, directory: str, src: ChunkSource, items: list[tuple[str, TensorEntry]], offs: list[int], *,
    written: Callable[[list[int]], None] | None = None, failed: list[BaseException] | None = None,
    owners: list[int] | None = None, read: Any = None,
) -> Iterator[list[WriteChunk]]:
    """Batches for ``io.write_batches`` of whole tensors ``items`` (``(manifest path, entry)``) at
    file offsets ``offs`` (increasing): up to ``GROUP`` bytes of them read in parallel (checksums
    verified) into one reused page-aligned buffer (new memory is slow to fault in), each at its file
    offset's place in a page, so that their whole pages can be written direct. A tensor larger than
    ``GROUP`` comes in pieces of whole checksum blocks (``_pieces``), one batch each, each read as
    the boxes of its elements (``flat_boxes``): memory holds ``GROUP`` bytes, not the largest
    tensor (a 1 GiB tensor took 1 GiB more before session 51). ``owners`` gets the index of the
    tensor of each chunk yielded (a tensor's checksums: its chunks' in order). ``written(indices)``
    once a batch is written, naming the tensors it completed; an error reading is also put in
    ``failed``. Used by ``consolidate`` and by the streamed safetensors export (``stwrite``). ``read``:
    another source of the bytes (``dcp_stream``'s reader of a DCP directory, for ``convert``), with
    ``plan(path, entry, box, dest)`` (what fills ``dest`` with the elements of ``box`` of the tensor)
    and ``run(plans)`` (does a batch's); ``src`` is not used then."""
    sizes = [e.nbytes for _p, e in items]
    pieces = _pieces(sizes)
    groups = _groups([offs[i] + at for i, at, _n in pieces], [n for _i, _at, n in pieces])
    span = [(offs[pieces[g[-1]][0]] + pieces[g[-1]][1] + pieces[g[-1]][2]) - (offs[pieces[g[0]][0]] + pieces[g[0]][1]) // PAGE * PAGE
            for g in groups]
    scratch = aligned_empty(max(span, default=0))
    for g in groups:
        base = (offs[pieces[g[0]][0]] + pieces[g[0]][1]) // PAGE * PAGE
        reads, chunks = [], []
        for i, start, n in (pieces[k] for k in g):
            path, e = items[i]
            at = offs[i] + start - base
            if n == e.nbytes:
                dest = scratch[at : at + n].view(e.torch_dtype).view(e.shape)
                reads.append(whole_read(src, path, e, dest) if read is None else read.plan(path, e, full_box(e.shape), dest))
            else:
                size = e.torch_dtype.itemsize
                for box, first in flat_boxes(e.shape, start // size, (start + n) // size):
                    b = at + first * size - start
                    dest = scratch[b : b + box.numel * size].view(e.torch_dtype).view(box.sizes)
                    reads.append(read.plan(path, e, box, dest) if read is not None else ReadTarget(
                        path, dest, box, plan_reads(plan_args(src.all_chunks(path, e)), box, size, src.m.block_size, True)))
            chunks.append(WriteChunk(tensor_bytes(scratch[at : at + n]), offs[i] + start))
            if owners is not None:
                owners.append(i)
        try:
            read_targets(storage, directory, reads) if read is None else read.run(reads)
        except BaseException as e:
            if failed is not None:
                failed.append(e)
            raise
        yield chunks
        if written is not None:
            written([i for i, start, n in (pieces[k] for k in g) if start + n == sizes[i]])


def whole_read(src: ChunkSource, path: str, e: TensorEntry, dest: torch.Tensor, verify: bool = True) -> ReadTarget:
    """The read of tensor ``path`` whole into ``dest`` from its chunks, whatever the saved sharding
    (``whole_batches``; ``export.iter_tensors``)."""
    box = full_box(e.shape)
    return ReadTarget(path, dest, box, plan_reads(plan_args(src.all_chunks(path, e)), box, e.torch_dtype.itemsize, src.m.block_size, verify))
