"""``save``: the collective entry point (``load`` lives in ``loader.py``).

Every rank calls ``save(path, state)`` with the same path and the same entry names; the
phases are::

    capture (sync, each rank, capture.py)  ->  round "begin" (agree on step, entries, save id)
    write own chunks + fsync               ->  gather "written" (chunks or traceback, to rank 0)
    rank 0: manifest.json LAST, rename temp dir  ->  broadcast "commit" outcome
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch

from . import __version__, iostall, layout, replicas, split, splitplan
from .capture import Leaf, Snapshot, _check_key, capture, check_data_positions, chunk_view, my_chunks  # noqa: F401
from .commit import LazyManifest, check_shared, commit_dir, occupied, rank_files
from .commitfail import check_commit, discard, discard_late
from .commitfence import abandon_commit, check_begin, claim_commit
from .dist import DistContext, check_timeout, one_operation
from .errors import (
    CheckpointError,
    RankFailureError,
    describe_error,
    error_text,
    failure_record,
    from_record,
    raise_failures,
)
from .faults import fault
from .flatten import decode_json, encode_json
from .gcpause import gc_paused
from .handle import SaveHandle
from .index import encode as encode_index
from .io import DEFAULT_BLOCK, WriteChunk, tensor_bytes, write_batches
from .manifest import Chunk, Manifest, TensorEntry, checksum
from .outtemp import owned, sweep
from .permanent import check_save_args, is_permanent, keeps_own
from .planner import check_cover, layout_file
from .samesave import recheck, written_etags
from .storage import Storage, for_path, location
from .storage._diskfull import save_failed
from .streams import has_device_chunks, host_batches, split_streams, write_streams
from .tied import format_for, resolve_aliases
from .userload import load  # noqa: F401  (tg.load: a damaged checkpoint's error says what to load instead)


@one_operation
def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    async_: bool = False,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    max_staging_bytes: int | None = None,
    stage_in_background: bool = False,
    split_state: bool = False,
) -> Any:
    """Save ``state`` into the checkpoint directory ``path`` (every rank calls it).

    Returns the committed :class:`Manifest` (on every rank), or with ``async_=True`` a
    ``SaveHandle`` whose ``result()`` gives it. Raises ``StepExistsError`` when ``path`` is
    already a checkpoint (``overwrite=True`` replaces it), ``UnsupportedValueError`` for a
    leaf that is neither a tensor nor JSON, ``RankFailureError`` when any rank failed.
    ``stage_in_background=True`` (with ``async_``): the call copies nothing; the caller must
    call ``handle.wait_staged()`` before mutating any tensor of ``state`` (docs/async.md).
    ``split_state=True`` (every rank): ranks may hold different tensors, e.g. pipeline stages (``split.py``).
    """
    if layout not in ("sharded", "full"):
        raise ValueError(f"layout={layout!r}: use 'sharded' (each rank writes its part) or 'full'")
    check_save_args(async_, overwrite, stage_in_background, split_state, max_staging_bytes, metadata)
    check_timeout(timeout)
    split.refuse_full(split_state, layout)
    storage, target = for_path(path, follow_link=True)
    handle = start_save(
        storage, target, state, DistContext.current(),
        async_=async_, layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout,
        max_staging_bytes=max_staging_bytes, stage_in_background=stage_in_background, split_state=split_state,
    )
    return handle if async_ else handle.result()


def start_save(
    storage: Storage,
    target: str,
    state: Mapping[str, Any],
    ctx: DistContext,
    *,
    async_: bool = False,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    step: int | None = None,
    max_staging_bytes: int | None = None,
    stage_in_background: bool = False,
    preflight: Exception | None = None,
    managed: bool = False,
    split_state: bool = False,
) -> SaveHandle:
    """Start a save on every rank; sync saves return an already completed handle. ``managed``: a
    ``CheckpointManager``'s save (an uncollected error of a direct async ``tg.save`` is not its own).
    ``max_staging_bytes`` caps the async path's host staging memory, ``stage_in_background``
    moves every copy to the save thread (docs/async.md); both only matter with ``async_``.
    ``preflight``: an error the caller found on this rank, raised in the first round (every rank fails)."""
    layout_mod.check_target(target, step)  # a step no manifest holds fails before a byte is written (tg.save: step-<n>)
    if async_:
        from . import forks  # noqa: F401  (the at-fork reset and the exit's drain, for code that imports this module only)
        from .async_save import STARTING, start_async_save

        # Its own channel: the background commit's collectives may interleave with the training thread's (the
        # manager's "decide") in a different order on each rank. One start at a time (async saves of two
        # threads): the second waits for the first save, as a save in one thread does.
        t0 = time.monotonic()
        with STARTING:
            handle = start_async_save(
                storage, target, state, ctx.channel("async-save", follow=True), layout=layout, metadata=metadata, overwrite=overwrite,
                timeout=timeout, step=step, max_staging_bytes=max_staging_bytes, stage_in_background=stage_in_background,
                preflight=preflight, managed=managed, split_state=split_state)
        handle.call_s = time.monotonic() - t0  # the whole call: its thread's start and the operation's end too
        return handle
    with gc_paused():
        snap = _collective_capture(state, ctx, layout, timeout, metadata, preflight, split_state)
        manifest = persist_and_commit(  # storage calls recorded: the watchdog ends a save stuck in one (iostall.py)
            iostall.watched(storage), target, snap, ctx, layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout, step=step)
        del snap  # freed now, by reference counts: not one more object for the pass that gc.enable() brings
    return SaveHandle.completed(manifest, manifest.step)


def _collective_capture(
    state: Mapping[str, Any], ctx: DistContext, layout_kind: str, timeout: float | None,
    metadata: Mapping[str, Any] | None = None, preflight: Exception | None = None, split_state: bool = False,
) -> Snapshot:
    """Phase 1 on every rank (sync and async saves): check ``metadata`` and capture ``state``. A
    rank that fails here (or brings a ``preflight`` error) tells the others in the "begin" round,
    so every rank raises at once."""
    try:
        if preflight is not None:
            raise preflight
        # Checked here, before a byte is written; saved as copied now (an async manifest comes later).
        meta = decode_json(encode_json(metadata), "metadata") if metadata else {}
        snap = capture(state, ctx=ctx, layout_kind=layout_kind, split=split_state)
        snap.metadata = meta
        return snap
    except Exception as e:
        # Tell the other ranks before raising, so they fail now instead of at the timeout.
        if ctx.is_distributed:
            # Every rank, this one included, raises the same RankFailureError.
            with keeps_own(e):  # the exchange lost (rank 0 read e, exited 78): e no restart fixes is raised
                begin = ctx.all_gather("begin", {"error": describe_error(e), "permanent": is_permanent(e)}, timeout=timeout)
            try:
                raise_failures("save", begin, ctx)
            except RankFailureError as f:  # ranks that captured met it in persist_and_commit's begin round
                f.captured_elsewhere = any("sig" in o for o in begin)  # type: ignore[attr-defined]
                raise
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"could not capture the state: {e}") from e


def persist_and_commit(
    storage: Storage,
    target: str,
    snap: Snapshot,
    ctx: DistContext,
    *,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    stage: Any = None,
    step: int | None = None,
) -> Manifest:
    """Phases 2 and 3 of a save, on every rank: write own chunks, exchange outcomes, commit.

    ``stage(mine)`` may supply the bytes of this rank's chunks ``mine`` (``capture.my_chunks``,
    known once the "begin" round agreed the per-rank loads): ``(phases, batches)``, the page
    phase of each chunk's source (or None; for the file layout) and a generator of batches of
    ``(index in mine, byte offset in that chunk, host tensor)``, each batch written before the
    next is requested (the async path, ``async_save._stage``). By default the bytes come from
    the tensors themselves. Safe on a background thread: it talks to other ranks via the store.
    """
    parent, name = os.path.split(target.rstrip("/"))
    shown = location(storage, target)  # in errors: s3://bucket/run/step-N, not bucket/run/step-N (a local path, as read)
    own = sum(lf.tensor.nbytes for lf in snap.leaves if lf.kind != "replicated" and lf.writer)
    managed, step = step is not None, layout_mod.parse_step(name) or 0 if step is None else step  # step: a manager's save
    hello: dict[str, Any] = {"sig": snap.entry_sig, "split": snap.split, "data": snap.data_positions, "step": step, "name": name, "own": own,
                             "error": None, "rep": replicas.hello(snap), "vals": replicas.values(snap, ctx.world_size)}
    if ctx.rank == 0:
        hello["id"] = uuid.uuid4().hex[:16]
        try:
            if not managed and storage.atomic_rename:  # killed earlier writers' temp directories (outtemp)
                sweep(storage.join(parent, name))
            hello.update(occupied(storage, storage.join(parent, name), overwrite, above=not managed))  # its root: checked at open
        except Exception as e:  # a listing that failed (name too long, no permission, EIO, an object store's error)
            if not ctx.is_distributed:  # a CheckpointError: a manager's on_error="warn" applies to it
                raise e if isinstance(e, CheckpointError) else CheckpointError(
                    f"save of {shown} failed: cannot look into {shown}: {error_text(e)}") from e
            hello["error"] = describe_error(e)  # in the begin round: every rank raises it, none waits for rank 0
    begin = ctx.all_gather("begin", hello, timeout=timeout)
    check_begin(begin, ctx)
    sigs, save_id = [b["sig"] for b in begin], begin[0]["id"]
    replicas.compare(ctx, snap, begin, sigs, timeout, step)  # replicated tensors that differ: a warning (rank 0)
    hashed = splitplan.owners(ctx, snap, sigs, timeout)  # split_state: tensors another group writes, hashed here
    work = storage.join(parent, layout_mod.tmp_dir(name, save_id) if storage.atomic_rename else name)
    with owned(work) if ctx.rank == 0 and not managed and storage.atomic_rename else nullcontext():
        report: dict[str, Any] = {"error": None}
        write_error: Exception | None = None  # one process: raised as itself (its type tells the cause)
        try:  # from here on a rank's error is reported in "written": no rank may leave the rounds early
            fault("begin", ctx.rank)
            storage.makedirs(work)
            report = _write_rank(storage, work, snap, ctx, [b["own"] for b in begin], stage, sigs, hashed)
            fault("written", ctx.rank)
        except Exception as e:
            report, write_error = {"error": describe_error(e)}, e
        except BaseException:  # Ctrl-C while writing, one process: no temp directory left behind
            if not ctx.is_distributed and storage.atomic_rename:  # (an object store writes in place: debris)
                storage.remove_tree(work)
            raise
        # Only rank 0 receives the chunk lists (a gather, not an all_gather: O(world) store traffic).
        outcome: dict[str, Any] = {"error": None}
        manifest = None
        try:
            written = ctx.gather("written", report, timeout=timeout)
        except RankFailureError as e:  # rank 0 only: a rank died or never reported
            written, outcome = None, failure_record(e)
        if ctx.rank == 0 and written is not None:
            try:
                raise_failures("save", written, ctx)
                manifest = _build_manifest(snap, written, ctx, layout, snap.metadata or metadata, step, sigs)
                check_shared(storage, work, written)
                fault("before_manifest", ctx.rank)
                claim_commit(ctx, save_id)
                # Invariant: the manifest is written only after every rank reported its data durable.
                commit_dir(storage, parent, name, work, manifest, overwrite, save_id)
                recheck(storage, work, written)  # object stores: another save of this step since the check before
                outcome = {"error": None, "step": manifest.step, "total_bytes": manifest.total_bytes}
            except RankFailureError as e:
                outcome = failure_record(e)
            except Exception as e:  # "permanent": every rank's error is (rank 0's run lock lost: runlock.check_owned)
                outcome = {"error": describe_error(e), "permanent": is_permanent(e)}
                write_error = write_error or e  # one process: raised as itself below (a StepExistsError stays one)
            except BaseException:  # Ctrl-C in the commit, one process: as above (gone once renamed); an
                if not ctx.is_distributed and storage.atomic_rename:  # object store's manifest IS the commit
                    storage.remove_tree(work)
                raise
        if ctx.rank == 0 and outcome.get("error"):  # the temp directory goes; a lost run lock is named as the cause
            outcome, write_error = discard(storage, work, outcome, write_error, written, manifest)
        try:
            outcome = ctx.broadcast("commit", outcome, timeout=timeout)
        except RankFailureError as e:  # another rank: gave up waiting for rank 0's outcome
            abandon_commit(ctx, save_id, shown, e)
        if ctx.rank != 0 and str(ctx.rank) in outcome.get("failures", {}):
            # Named as failed: maybe a late rank that (re)created the temp directory after rank 0 removed it.
            discard_late(storage, work, outcome, report)  # not another save's step (object stores: samesave)
        if write_error is not None and not ctx.is_distributed:  # one process: the error itself, after the cleanup
            raise save_failed(write_error, shown)  # a DiskFullError stays one; ENOSPC creating a file (inodes) becomes one
        if outcome.get("failures"):
            raise from_record(outcome)
        check_commit(shown, outcome)  # rank 0's failed commit: raised on every rank (permanent as rank 0's error was)
        if manifest is None:  # other ranks: no manifest read per rank per save (thousands of ranks)
            return LazyManifest(storage, storage.join(parent, name), outcome["step"], outcome["total_bytes"])  # type: ignore[return-value]
        return manifest


layout_mod = layout  # the module, shadowed by the ``layout`` keyword in this file

def _write_rank(
    storage: Storage, work: str, snap: Snapshot, ctx: DistContext, base_loads: list[int], stage: Any, sigs: list[str],
    hashed: set[str],
) -> dict[str, Any]:
    mine = my_chunks(snap, ctx, base_loads, split.groups(sigs)[sigs[ctx.rank]] if snap.split else None)
    fname, skip = layout_mod.data_file(ctx.rank), splitplan.Hashed(mine, hashed, DEFAULT_BLOCK)  # skip: hashed, not written
    if stage is None and has_device_chunks(mine):
        stage = host_batches  # sync, device chunks: through a bounded host buffer, batch by batch
    if stage is None:  # sync: write straight from the tensors' memory
        cpu = [tensor_bytes(chunk_view(lf, b)) for lf, b in mine]
        lengths, keep = [len(v) for v in cpu], skip.keep()
        streams = split_streams([mine[i] for i in keep], [lengths[i] for i in keep])
        got = write_streams(storage, work, ctx.rank, [cpu[i] for i in keep], streams, DEFAULT_BLOCK)
        offsets, sums, names, files = skip.spread(keep, got, cpu)  # the skipped chunks hashed, no file
    else:  # async, or device chunks: host copies or live CPU tensors, batch by batch, one file
        lengths, (phases, batches) = [chunk_view(lf, b).nbytes for lf, b in mine], stage(mine)
        offsets, size = layout_file([0 if s else n for n, s in zip(lengths, skip.skip)], phases=phases)
        sums = skip.fill(_write_staged(storage, storage.join(work, fname), batches, offsets, size, ctx.rank, skip))
        names, files = [None if s else fname for s in skip.skip], {fname: size}
    chunks = [
        [lf.path, lf.dtype, list(lf.shape), list(b.offsets), list(b.sizes), o, n, s, f]
        for (lf, b), n, o, s, f in zip(mine, lengths, offsets, sums, names)
        if lf.regular is None
    ]
    size = files.get(fname, 0)
    # Regular parts (format 2) go to this rank's index file, not to rank 0: the report stays
    # O(1) per rank instead of O(tensors). Durable before this rank reports success.
    regular = {lf.path: (o, n, s) for (lf, _b), n, o, s in zip(mine, lengths, offsets, sums) if lf.regular is not None}
    index = None
    if regular:
        data = encode_index(fname, regular)
        iname = layout_mod.index_file(ctx.rank)
        getattr(storage, "write_new", storage.write_atomic)(storage.join(work, iname), data)  # S3: not over another save's
        index = [iname, len(data), checksum(data)]
    local_objects = {k: snap.objects[k] for k in snap.rank_local}
    return {
        "error": None, "file": fname, "size": size, "files": files, "chunks": chunks, "index": index,
        "objects": local_objects, "split": split.leader_report(snap, sigs, ctx.rank),
        "etags": written_etags(storage, work, [*files, *(index[:1] if index else [])]),  # object stores: samesave
    }


def _write_staged(
    storage: Storage, path: str, batches: Any, offsets: list[int], size: int, rank: int, skip: splitplan.Hashed
) -> list[list[str]]:
    """Write the async path's batches of ``(chunk index, byte offset in the chunk, host tensor)``, but
    for the chunks ``skip`` hashes (``splitplan.Hashed``); returns each chunk's block checksums (a
    split chunk's pieces start on block boundaries)."""
    order: list[int] = []

    def chunks() -> Any:
        try:
            for batch in batches:
                batch = skip.take(batch, tensor_bytes)  # hashed before the next batch reuses the buffer
                order.extend(i for i, _, _ in batch)
                yield [WriteChunk(tensor_bytes(t), offsets[i] + start) for i, start, t in batch]
        finally:
            batches.close()  # stops staging (and releases a waiting step()) if writing failed

    flat = write_batches(storage, path, chunks(), size, block=DEFAULT_BLOCK, fault=lambda p: fault(p, rank))
    sums: list[list[str]] = [[] for _ in offsets]
    for i, s in zip(order, flat, strict=True):
        sums[i] += s
    return sums

def _build_manifest(
    snap: Snapshot, written: list[Any], ctx: DistContext, layout: str, metadata: Mapping[str, Any] | None, step: int,
    sigs: list[str],
) -> Manifest:
    if snap.split:  # an entry that several stages hold: committed once (split.py)
        split.dedupe(written, sigs)
    tensors: dict[str, TensorEntry] = {
        lf.path: TensorEntry(lf.dtype, list(lf.shape), [], lf.regular, lf.alias)
        for lf in snap.leaves if lf.regular is not None or lf.alias is not None
    }
    files: dict[str, int] = {}
    indexes: dict[str, tuple[int, str]] = {}
    for w in written:
        for fname, size in rank_files(w).items():
            if size or w.get("index") and fname == w["file"]:
                files[fname] = size
        if w.get("index"):
            indexes[w["index"][0]] = (w["index"][1], w["index"][2])
        for c in w["chunks"]:  # [path, dtype, shape, offsets, sizes, byte offset, length, sums, file]
            e = tensors.get(c[0])
            if e is None:  # every reported path gets an entry, chunkless ones too
                e = tensors[c[0]] = TensorEntry(c[1], c[2], [])
            if c[6]:  # an empty chunk (empty tensor or shard) names a file that may hold nothing
                e.chunks.append(Chunk(c[3], c[4], c[8] if len(c) > 8 else w["file"], c[5], c[6], c[7]))
    for lf in snap.leaves:  # zero-size tensors have no chunks but must exist
        if lf.kind != "local" and lf.path not in tensors:
            tensors[lf.path] = TensorEntry(lf.dtype, list(lf.shape), [])
    objects: dict[str, Any] = {}
    for key, skel in snap.objects.items():
        if key in snap.rank_local:
            objects[key] = {"ranks": [w["objects"].get(key) for w in written]}  # None: a stage without it
        else:
            objects[key] = {"skeleton": skel, **snap.beside(key)}  # "frozen", "class"
    split.add_reported(tensors, objects, written, TensorEntry)  # other stages' skeletons and chunkless tensors
    for e in tensors.values():
        if len(e.chunks) > 1:
            e.chunks.sort(key=lambda c: (c.offsets, c.file))
    check_cover(tensors)  # no commit that no load would accept
    resolve_aliases(tensors, "save")  # an alias shares its target's chunks, as manifest.validate gives them
    return Manifest(
        step=step or 0,
        world_size=ctx.world_size,
        created=time.time(),
        layout=layout,
        block_size=DEFAULT_BLOCK,
        files=files,
        objects=objects,
        tensors=dict(sorted(tensors.items())),
        metadata=dict(metadata or {}),
        library=f"trainguard {__version__}",
        torch_version=torch.__version__,
        # Format 1 unless a tensor is regular (2) or an alias (3): saves without them are unchanged.
        format_version=format_for(tensors.values()),
        indexes=indexes,
    )
