"""Asynchronous saving in three phases: stage, persist, commit (DESIGN.md, "Async save").

Called by ``api.start_save(async_=True)`` on every rank, from the training thread:

1. **capture + sync stage** (training thread, the only part that blocks training): wait for the
   previous save in flight, take the state apart (``api.capture``), and copy into the staging
   pool every tensor that may change before the next ``optimizer.step()``: module buffers
   (BatchNorm statistics change in forward), RNG state, plain tensors, and parameters of no
   optimizer in the state.
2. **background stage** (one daemon thread per save): parameters held by an optimizer of the
   state and that optimizer's state tensors change only inside ``optimizer.step()``, so they
   are copied while training runs forward/backward. A step *pre-hook* on each such optimizer
   (registered once, weak registry) blocks ``step()`` until these copies are done; the time it
   blocks is added to ``handle.hook_wait_s`` and reported as stall by the manager.
3. **persist + commit** (same thread): ``api.persist_and_commit`` writes the staged bytes and
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
from collections.abc import Mapping
from typing import Any

import torch

from .api import Leaf, _collective_capture, chunk_view, persist_and_commit
from .dist import DistContext, is_dtensor
from .errors import CheckpointError
from .handle import SaveHandle
from .planner import Box
from .stage import StagingPool, copy_into, default_pool
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
        self.copies: dict[int, torch.Tensor] = {}  # id(leaf) -> staged host tensor
        self.background: list[tuple[Leaf, torch.Tensor]] = []  # (leaf, slot) copied by the thread
        self.direct = 0  # leaves past the cap: written from the live tensors
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
    snap = _collective_capture(state, ctx, layout, timeout)
    protected, optimizers = _protected(state)
    handle = SaveHandle(step)
    pool = default_pool(max_staging_bytes)
    job = _Job(handle, pool, optimizers)
    todo = [lf for lf in snap.leaves if lf.writer or lf.kind == "replicated"]
    now = [lf for lf in todo if _ptr(lf.tensor) not in protected]
    later = [lf for lf in todo if _ptr(lf.tensor) in protected]
    slots = pool.acquire([lf.tensor.nbytes for lf in now + later], required=len(now))
    try:
        for lf, slot in zip(now, slots[: len(now)], strict=True):
            job.copies[id(lf)] = copy_into(slot, lf.tensor)  # type: ignore[arg-type]
        for lf, slot in zip(later, slots[len(now) :], strict=True):
            if slot is None:
                job.direct += 1
            else:
                job.background.append((lf, slot))
        for lf, _ in job.background:
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
    """The save thread: background copies, then persist and commit; always releases the pool."""
    handle = job.handle
    try:
        if job.error is None:
            try:
                _stage_background(job)
            except Exception as e:
                job.error = e
        if job.direct == 0:
            handle.set_staged()  # training may step: nothing reads the live tensors any more

        def stage(lf: Leaf, box: Box) -> torch.Tensor:
            if job.error is not None:  # reported to every rank by the "written" round
                raise CheckpointError(f"staging failed on rank {ctx.rank}: {job.error!r}") from job.error
            t = job.copies.get(id(lf))
            if t is None:  # past the staging cap: the live tensor, protected until done
                return chunk_view(lf, box)
            return chunk_view(Leaf(lf.path, t, lf.dtype, lf.shape, lf.box, lf.kind, lf.writer), box)

        manifest = persist_and_commit(storage, target, snap, ctx, stage=stage, **kw)
        outcome: tuple[Any, BaseException | None] = (manifest, None)
    except BaseException as e:  # surfaced by handle.result() at the next save/wait/close
        outcome = (None, e)
    job.copies.clear()
    job.background.clear()
    job.pool.release()
    if outcome[1] is None:
        handle.set_result(outcome[0])
        log.info(
            "trainguard: async save of step %s committed; training blocked %.4f s (call %.4f s, pre-step wait %.4f s)",
            handle.step, handle.call_s + handle.hook_wait_s, handle.call_s, handle.hook_wait_s,
        )
    else:
        handle.set_error(outcome[1])


def _stage_background(job: _Job) -> None:
    if _before_background_stage is not None:
        _before_background_stage()
    streams: dict[int, Any] = {}
    for idx, ev in job.cuda_events.items():
        s = torch.cuda.Stream(device=idx)
        s.wait_event(ev)
        streams[idx] = s
    for lf, slot in job.background:
        stream = streams.get(lf.tensor.device.index) if lf.tensor.is_cuda else None
        job.copies[id(lf)] = copy_into(slot, lf.tensor, stream)
    for s in streams.values():
        s.synchronize()


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
