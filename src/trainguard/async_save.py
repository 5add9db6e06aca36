"""Asynchronous saving in three phases: stage, persist, commit (DESIGN.md, "Async save").

Called by ``api.start_save(async_=True)`` on every rank, from the training thread:

1. **capture + sync stage** (training thread, the only part that blocks training): wait for the
   previous save in flight, take the state apart (``api.capture``), and copy into the staging
   pool every tensor that may change before the next ``optimizer.step()``: module buffers
   (BatchNorm statistics change in forward), RNG state, plain tensors, and parameters of no
   optimizer in the state.
2. **background stage** (the save thread, after the "begin" round has fixed which chunks this
   rank writes): parameters held by an optimizer of the state and that optimizer's state
   tensors change only inside ``optimizer.step()``, so only *this rank's chunks* of them (its
   share of replicated tensors, its shards) are copied, while training runs forward/backward.
   With ``max_staging_bytes`` they are copied in batches that fit the cap, each batch written
   before the next is copied into the same buffer. A step *pre-hook* on each such optimizer
   (registered once, weak registry) blocks ``step()`` until the last of them is copied (with a
   small cap: until the last batch is staged); the time it blocks is added to
   ``handle.hook_wait_s`` and reported as stall by the manager.
3. **persist + commit** (same thread, around step 2): ``api.persist_and_commit`` writes the staged bytes and
   commits through the c10d store (never the training process group), so it is safe while
   training runs collectives. Its error is stored in the handle and surfaces on every rank at
   the next ``save()``/``wait()``/``close()``.

Contract for user code: tensors that are not parameters/optimizer state are copied at the call.
Code that mutates *parameters* outside ``optimizer.step()`` (EMA, weight clipping, manual
updates) must call ``handle.wait_staged()`` first.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from .api import Leaf, _collective_capture, chunk_view, persist_and_commit
from .dist import DistContext
from .dtensor import is_dtensor
from .errors import CheckpointError
from .gcpause import gc_paused
from .handle import SaveHandle
from .io import DEFAULT_BLOCK
from .planner import Box
from .stage import StagingPool, _round_up, copy_into, default_pool, slot_room, slot_start
from .storage import Storage

log = logging.getLogger("trainguard")

# Optimizers that carry our step pre-hook (registered once each, dropped with the optimizer).
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_INFLIGHT: _Job | None = None  # the one save in flight in this process
# Test seam: called by the save thread before its background copies (tests hold staging open).
_before_background_stage: Any = None


class _Job:
    """One async save's staging state, shared by the training thread and the save thread."""

    def __init__(self, handle: SaveHandle, pool: StagingPool, optimizers: list[torch.optim.Optimizer]) -> None:
        self.handle = handle
        self.pool = pool
        self.optimizer_ids = {id(o) for o in optimizers}
        self.copies: dict[int, torch.Tensor] = {}  # id(leaf) -> host copy made in the call
        self.later: set[int] = set()  # id(leaf) of leaves the save thread stages (its chunks only)
        self.error: BaseException | None = None
        self.cuda_events: dict[int, Any] = {}  # device index -> event recorded at save time


def start_async_save(
    storage: Storage,
    target: str,
    state: Mapping[str, Any],
    ctx: DistContext,
    *,
    layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    step: int | None = None,
    max_staging_bytes: int | None = None,
) -> SaveHandle:
    """Start an async save on this rank (every rank calls it, same order); returns its handle.

    Blocks only for the previous save in flight, the capture and the synchronous copies. Raises
    ``CheckpointError`` here if the previous save failed and nobody has seen its error yet.
    """
    t0 = time.monotonic()
    _finish_previous()
    with gc_paused():
        snap = _collective_capture(state, ctx, layout, timeout)
    protected, optimizers = _protected(state)
    handle = SaveHandle(step)
    pool = default_pool(max_staging_bytes)
    job = _Job(handle, pool, optimizers)
    todo = [lf for lf in snap.leaves if lf.writer or lf.kind == "replicated"]
    now = [lf for lf in todo if _ptr(lf.tensor) not in protected]
    later = [lf for lf in todo if _ptr(lf.tensor) in protected]
    slots = pool.acquire([lf.tensor.nbytes for lf in now])
    try:
        for lf, slot in zip(now, slots, strict=True):
            job.copies[id(lf)] = copy_into(slot, lf.tensor)
            handle.staged_sync_bytes += lf.tensor.nbytes
        job.later = {id(lf) for lf in later}
        for lf in later:
            if lf.tensor.is_cuda and lf.tensor.device.index not in job.cuda_events:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(lf.tensor.device))  # copies start after pending kernels
                job.cuda_events[lf.tensor.device.index] = ev
    except Exception as e:  # still join the collective rounds, so every rank fails together
        job.error = e
    _hook(optimizers)
    handle.call_s = time.monotonic() - t0
    handle.bytes = sum(lf.tensor.nbytes for lf in todo)
    thread = threading.Thread(
        target=_run, args=(job, storage, target, snap, ctx),
        kwargs=dict(layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout, step=step),
        name="trainguard-async-save", daemon=True,
    )
    handle.attach_thread(thread)
    global _INFLIGHT
    with _LOCK:
        _INFLIGHT = job
    thread.start()
    return handle


def _run(job: _Job, storage: Storage, target: str, snap: Any, ctx: DistContext, **kw: Any) -> None:
    """The save thread: persist and commit, staging this rank's chunks in between (after the
    "begin" round, batch by batch as ``api._write_rank`` writes them); always releases the pool."""
    handle = job.handle
    try:
        manifest = persist_and_commit(
            storage, target, snap, ctx, stage=lambda mine: _batches(job, mine, ctx.rank), **kw
        )
        outcome: tuple[Any, BaseException | None] = (manifest, None)
    except BaseException as e:  # surfaced by handle.result() at the next save/wait/close
        outcome = (None, e)
    job.copies.clear()
    job.pool.release()
    if outcome[1] is None:
        handle.set_result(outcome[0])
        log.info(
            "trainguard: async save of step %s committed; training blocked %.4f s (call %.4f s, pre-step wait %.4f s)",
            handle.step, handle.call_s + handle.hook_wait_s, handle.call_s, handle.hook_wait_s,
        )
    else:
        handle.set_error(outcome[1])


Batch = list[tuple[int, int, torch.Tensor]]  # (index in ``mine``, byte offset in that chunk, host bytes)


def _batches(job: _Job, mine: list[tuple[Leaf, Box]], rank: int) -> Iterator[Batch]:
    """The ``stage`` of ``api._write_rank`` (save thread): batches of host bytes of this rank's
    chunks, in ``mine`` (= file) order: io.write_batches needs batches that do not interleave.
    Copies made in the call join the batch as they are; parameters and optimizer state are copied
    into the background buffer, one buffer-full per batch. A batch's buffer is reused for
    the next one once ``io.write_batches`` asks for it (it has written the batch by then).
    Sets ``staged`` when the last protected chunk is copied, or when staging stops."""
    try:
        if job.error is not None:  # reported to every rank by the "written" round
            raise job.error
        todo: list[tuple[int, torch.Tensor, bool]] = []  # (index, chunk, already a host copy), in file order
        for i, (lf, box) in enumerate(mine):
            copy = job.copies.get(id(lf))
            if copy is not None:
                todo.append((i, chunk_view(replace(lf, tensor=copy), box), True))
            elif id(lf) in job.later:
                todo.append((i, chunk_view(lf, box), False))
            else:
                raise CheckpointError(f"{lf.path}: chunk neither copied nor staged (internal error)")
        yield from _stage_background(job, todo)
    except CheckpointError as e:
        raise CheckpointError(f"staging failed on rank {rank}: {e}") from e
    except Exception as e:
        raise CheckpointError(f"staging failed on rank {rank}: {e!r}") from e
    finally:
        job.handle.set_staged()  # never leave step() blocked, whatever happened


def _stage_background(job: _Job, todo: list[tuple[int, torch.Tensor, bool]]) -> Iterator[Batch]:
    if _before_background_stage is not None:
        _before_background_stage()
    streams: dict[int, Any] = {}
    for idx, ev in job.cuda_events.items():
        s = torch.cuda.Stream(device=idx)
        s.wait_event(ev)
        streams[idx] = s
    srcs = [(i, _as_bytes(t), ready) for i, t, ready in todo]
    sizes = [b.numel() for _, b, ready in srcs if not ready]
    room = job.pool.background_bytes(slot_room(sizes), max(sizes, default=0), block=DEFAULT_BLOCK)
    buf = job.pool.buffer(room)
    h = job.handle
    batch: Batch = []
    pos = 0
    for i, src, ready in srcs:
        n, start = src.numel(), 0
        if ready or n == 0:
            batch.append((i, 0, src))
            continue
        while start < n:
            # Large chunks start on a page in the file (planner.layout_file) and their pieces on a
            # block: on a page here too, so the writer can send them with O_DIRECT.
            pos = min(slot_start(pos, n), room)
            free = max(room - pos, 0)
            # A piece of a split chunk starts on a checksum block of its chunk.
            piece = n - start if n - start <= free else free // DEFAULT_BLOCK * DEFAULT_BLOCK
            if piece == 0:  # the buffer is full: write it, then reuse it
                _sync(streams)
                h.staging_batches += 1
                yield batch
                batch, pos = [], 0
                continue
            stream = streams.get(src.device.index) if src.is_cuda else None
            batch.append((i, start, copy_into(buf[pos : pos + piece], src[start : start + piece], stream)))
            h.staged_background_bytes += piece
            pos, start = _round_up(pos + piece), start + piece
    _sync(streams)
    h.set_staged()  # the last parameter/optimizer chunk is copied: step() may run
    h.staging_batches += 1
    yield batch


def _sync(streams: dict[int, Any]) -> None:
    for s in streams.values():
        s.synchronize()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, same device)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _finish_previous() -> None:
    """One save in flight: wait for the previous one; raise its error if nobody observed it."""
    with _LOCK:
        prev = _INFLIGHT
    if prev is None:
        return
    h = prev.handle
    h.join()
    err = h.exception()
    if err is not None and not h.observed:
        h.observed = True
        raise CheckpointError(f"the previous async save (step {h.step}) failed: {err}") from err


def _pre_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Runs at the start of every ``step()`` of a hooked optimizer, in the training thread."""
    job = _INFLIGHT
    if job is None or id(optimizer) not in job.optimizer_ids:
        return
    h = job.handle
    if h.staged():
        return
    t0 = time.monotonic()
    h.waiting.set()
    h.wait_staged()
    h.hook_wait_s += time.monotonic() - t0


def _hook(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        if opt not in _HOOKED:
            _HOOKED[opt] = opt.register_step_pre_hook(_pre_step_hook)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _ptr(t: torch.Tensor) -> tuple[int, int, str] | None:
    if t.numel() == 0:
        return None
    return (t.data_ptr(), t.nbytes, str(t.device))


def _protected(state: Mapping[str, Any]) -> tuple[set[Any], list[torch.optim.Optimizer]]:
    """Tensors that change only in ``step()`` of an optimizer in the state (identified by data
    pointer, size and device), and those optimizers. Parameters of no such optimizer are not
    protected: something else may update them, so they are copied at the call."""
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    out: set[Any] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.add(_ptr(_local(p.detach())))
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out.add(_ptr(_local(v.detach())))
    out.discard(None)
    return out, optimizers
