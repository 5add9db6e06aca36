"""Asynchronous saving in three phases: stage, persist, commit (DESIGN.md, "Async save").

Called by ``api.start_save(async_=True)`` on every rank, from the training thread:

1. **capture + sync stage** (training thread, the only part that blocks training): wait for the
   previous save in flight, take the state apart (``api.capture``), and copy into the staging pool
   every tensor that may change before the next ``optimizer.step()``: module buffers (BatchNorm
   statistics change in forward), RNG state, plain tensors, and parameters of no optimizer in the state.
2. **background stage** (the save thread, after the "begin" round has fixed which chunks this
   rank writes): only *this rank's chunks* of the parameters of an optimizer in the state and of
   its state tensors (they change only inside ``step()``), while forward/backward run; with
   ``max_staging_bytes`` in batches, each written before the next is copied into the same buffer.
   A step *pre-hook* (torch's global one, registered once) blocks ``step()`` of such an optimizer,
   and of any other over a tensor still to be copied, until the last is copied; the time it
   blocks goes to ``handle.hook_wait_s``, reported as stall by the manager.
3. **persist + commit** (same thread, around step 2): ``api.persist_and_commit`` writes the staged
   bytes (through ``iostall.watched``) and commits through the c10d store (never the training process
   group). Its error is stored in the handle, raised on every rank at the next ``save``/``wait``/``close``.

Contract: code that mutates parameters or optimizer state outside ``step()`` (EMA) calls
``handle.wait_staged()`` first; with ``stage_in_background=True``, before mutating any tensor.

The job's state (``_Job``) and the save thread's background copies (``_stage_background``) live in
``asyncjob.py``.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import gcpause, iostall, walks
from .api import Leaf, _collective_capture, chunk_view, persist_and_commit
from .asyncjob import Todo, _Job, _stage_background
from .buffers import as_bytes
from .dist import DistContext, default_timeout
from .errors import CheckpointError, RankFailureError
from .handle import SaveHandle
from .planner import PAGE, Box
from .stage import (
    StorageKeys,
    default_pool,
    optimizer_writes,
    protected_tensors,
    trim_idle_pools,
    zero_copy_ok,
)
from .stagecopy import Batch, copy_into
from .storage import Storage

log = logging.getLogger("trainguard")

# The step pre-hook of every optimizer of the process (torch's global one), registered once.
_HOOK: Any = None
_LOCK = threading.Lock()
STARTING = threading.RLock()  # held by api.start_save around start_async_save: two threads' saves in turn
_INFLIGHT: _Job | None = None  # the one save in flight in this process
_UNCOLLECTED: SaveHandle | None = None  # a direct tg.save's failed handle, for the next direct async save
_before_background_stage: Any = None  # test seam: the save thread calls it before its background copies


def start_async_save(
    storage: Storage, target: str, state: Mapping[str, Any], ctx: DistContext, *, layout: str = "sharded",
    metadata: Mapping[str, Any] | None = None, overwrite: bool = False, timeout: float | None = None,
    step: int | None = None, max_staging_bytes: int | None = None, stage_in_background: bool = False,
    preflight: Exception | None = None, managed: bool = False, split_state: bool = False,
) -> SaveHandle:
    """Start an async save on this rank (every rank calls it, same order); returns its handle.

    Blocks only for the previous save in flight, the capture and the synchronous copies. Raises
    ``CheckpointError`` here if a direct ``tg.save`` failed and nobody has seen its error yet
    (not in a manager's save: ``managed``).
    ``stage_in_background``: no copy in the call; the save thread stages every tensor (only this
    rank's chunks), and the caller waits for ``handle.wait_staged()`` before mutating any tensor
    of the state (``step()`` of an optimizer in the state still waits by itself).
    """
    _finish_previous(managed, timeout)
    gcpause.expire()  # the collector waits until the save thread ends (gcpause.py); released here if none begins
    with ctx.operation(eager=True), gcpause.held(gcpause.ASYNC_HOLD_S) as hold:  # its thread's rounds too (dist.py)
        with walks.shared():  # the capture and protected_tensors walk each module once (walks.py)
            try:
                snap = _collective_capture(state, ctx, layout, timeout, metadata, preflight, split_state)
            except RankFailureError as e:  # raised here while the ranks that captured fail in their handles
                if not getattr(e, "captured_elsewhere", False):
                    raise
                gcpause.release(hold)
                return _failed(e, step, managed, target)
            protected, optimizers = protected_tensors(state)
        handle = SaveHandle(step, target)
        handle.limit, handle.rank, handle.gc_hold = timeout or default_timeout(), ctx.rank, hold  # limit bounds its waits
        pool = default_pool(max_staging_bytes, _USERS, managed)  # the other open managers' caps keep their pools
        job = _Job(handle, pool, optimizers)
        todo = [lf for lf in snap.leaves if lf.writer or lf.kind == "replicated"]
        now, later = [], todo if stage_in_background else []
        for lf in () if stage_in_background else todo:  # tensor_key(t) in protected (None, of an empty tensor, never is)
            (later if (n := (t := lf.tensor).nbytes) and (t.data_ptr(), n, t.device) in protected else now).append(lf)
        now, later, short = pool.fit_sync(now, later)  # short: they did not fit in memory, the call waits for staged()
        slots = pool.acquire([lf.tensor.nbytes for lf in now])
        try:
            try:
                for lf, slot in zip(now, slots, strict=True):
                    job.copies[id(lf)] = copy_into(slot, lf.tensor)
                    handle.staged_sync_bytes += lf.tensor.nbytes
                job.later = {id(lf) for lf in later}
                handle.watch(later)  # changed before staged(): warned (handle.py)
                job.storages = StorageKeys(later)
                for lf in later:
                    if lf.tensor.is_cuda and lf.tensor.device.index not in job.cuda_events:
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(lf.tensor.device))  # copies start after pending kernels
                        job.cuda_events[lf.tensor.device.index] = ev
            except Exception as e:  # still join the collective rounds, so every rank fails together
                job.error = e
            job.zero_copy = zero_copy_ok(storage, [lf.tensor for lf in later])
            _hook()
            handle.bytes = sum(lf.tensor.nbytes for lf in todo)
            thread = threading.Thread(  # the snapshot in a list _run empties: freed before the collector resumes
                target=_run, args=(job, storage, target, [snap], ctx),
                kwargs=dict(layout=layout, metadata=metadata, overwrite=overwrite, timeout=timeout, step=step),
                name="trainguard-async-save", daemon=True,
            )
            handle.attach_thread(thread)
        except BaseException:  # e.g. KeyboardInterrupt in the copies: the pool must not stay held
            job.release()
            raise
        global _INFLIGHT
        try:  # the thread runs the call's rounds: a Ctrl-C from here on leaves it running them, not LEFT (dist.py)
            with _LOCK:  # in the try: a Ctrl-C as this block exits left an unstarted save in flight (step() hung)
                _INFLIGHT = job
            ctx.hand_off(True)
            try:
                thread.start()
            finally:  # the new thread held the GIL for up to a switch interval (5 ms) while this call waited
                job.go.set()
            if short:  # the save thread stages what the call could not copy, in batches that fit: wait here
                handle.block_until_staged()
            return handle
        except BaseException as e:  # no thread ("can't start new thread", Ctrl-C): nothing would release the pool or step()
            with _LOCK:  # the OS thread may exist and run later (Ctrl-C while start() waited for it): _run decides
                if job.began:  # it runs: it releases them; a manager collects its handle (CheckpointManager._save_now)
                    e.save_handle = handle  # type: ignore[attr-defined]
                    raise
                job.began = _INFLIGHT = None  # cancelled; the previous save is finished (_finish_previous)
            ctx.hand_off(False)  # this rank left the save: the others fail it at once
            job.release()
            if not isinstance(e, Exception):
                raise
            raise CheckpointError(f"could not start the async save thread: {e}") from e


def _failed(e: RankFailureError, step: int | None, managed: bool, target: str) -> SaveHandle:
    """This rank failed the capture round while other ranks captured (a lazy module uninitialized here, a
    rollback's set-aside failing on rank 0): their save threads fail their handles with this error, so this
    rank's save fails in its handle too, raised at the same next call on every rank (not one call ahead)."""
    global _UNCOLLECTED
    h = SaveHandle(step, target)
    h.set_error(e)
    if not managed:  # the next direct async save raises it, as the other ranks' does
        _UNCOLLECTED = h
    return h


def _run(job: _Job, storage: Storage, target: str, boxed: list[Any], ctx: DistContext, **kw: Any) -> None:
    """The save thread: persist and commit, staging this rank's chunks in between (after the "begin" round, batch by
    batch as ``api._write_rank`` writes them); then ``job.release()`` (``boxed``: the snapshot, freed before it)."""
    handle = job.handle
    job.go.wait(60)  # until the training thread's start() returned: training goes on first
    snap = boxed.pop()
    with _LOCK:  # a Ctrl-C in thread.start() before this ran took the save out of flight (start_async_save)
        if job.began is None:
            return
        job.began = True
    try:
        manifest = persist_and_commit(iostall.watched(storage), target, snap, ctx, stage=lambda mine: _stage(job, mine, ctx.rank), **kw)
        outcome: tuple[Any, BaseException | None] = (manifest, None)
    except BaseException as e:  # surfaced by handle.result() at the next save/wait/close
        outcome = (None, e)
    del snap
    job.release()
    if outcome[1] is None:
        handle.set_result(outcome[0])
        log.info(
            "trainguard: async save of step %s committed; training blocked %.4f s (call %.4f s, pre-step wait %.4f s)",
            handle.step, handle.call_s + handle.hook_wait_s, handle.call_s, handle.hook_wait_s,
        )
    else:
        handle.set_error(outcome[1])


ZERO_COPY_BATCH = 256 << 20  # zero-copy writes' batch size; between two, the save thread copies the rest if step() waits
def _stage(job: _Job, mine: list[tuple[Leaf, Box]], rank: int) -> tuple[list[int] | None, Iterator[Batch]]:
    """The ``stage`` of ``api._write_rank`` (save thread): the page phase of each chunk's
    source (where ``planner.layout_file`` puts it within a page of the file, so that its pages
    can go O_DIRECT), and the batches (:func:`_batches`)."""
    todo: Todo = []
    try:
        for i, (lf, box) in enumerate(mine):
            copy = job.copies.get(id(lf))
            if copy is not None:
                todo.append((i, as_bytes(chunk_view(replace(lf, tensor=copy), box)), True, 0))
            elif id(lf) in job.later:
                t = chunk_view(lf, box)
                phase = t.data_ptr() % PAGE if job.zero_copy and t.is_contiguous() and t.numel() else 0
                todo.append((i, as_bytes(t), False, phase if phase % 64 == 0 else 0))
            else:
                raise CheckpointError(f"{lf.path}: chunk neither copied nor staged (internal error)")
    except Exception as e:  # raised from the batches, where the write path reports it
        return None, _batches(job, None, rank, e)
    phases = [(t.data_ptr() % PAGE if ready and t.numel() else p) for _i, t, ready, p in todo]
    return phases, _batches(job, todo, rank, None)


def _batches(job: _Job, todo: Todo | None, rank: int, error: BaseException | None) -> Iterator[Batch]:
    """Batches of host bytes of this rank's chunks, in file order (io.write_batches needs
    batches that do not interleave). Copies made in the call join the batch as they are;
    parameters and optimizer state are written from their own memory (``job.zero_copy``) or
    copied into the background buffer, one buffer-full per batch; a batch's buffer is reused
    for the next one once ``io.write_batches`` asks for it (it has written the batch by then).
    Sets ``staged`` when the last protected chunk is copied or written, or when staging stops."""
    try:
        if job.error is not None:  # reported to every rank by the "written" round
            raise job.error
        if error is not None:
            raise error
        assert todo is not None
        if _before_background_stage is not None:
            _before_background_stage()
        yield from (_write_live if job.zero_copy else _stage_background)(job, todo)
    except CheckpointError as e:
        raise CheckpointError(f"staging failed on rank {rank}: {e}") from e
    except Exception as e:
        raise CheckpointError(f"staging failed on rank {rank}: {e!r}") from e
    finally:
        job.handle.set_staged()  # never leave step() blocked, whatever happened


def _write_live(job: _Job, todo: Todo) -> Iterator[Batch]:
    """Zero-copy: the protected chunks are written (and checksummed) from the live tensors,
    about ``ZERO_COPY_BATCH`` bytes per batch, while forward/backward only read them; ``staged``
    is set once the last batch is written. If ``step()`` (the pre-step hook) or ``wait_staged()``
    is waiting when a batch is done, the chunks not yet written are copied into the staging
    buffer at once (the caller is blocked anyway; a memcpy is much faster than the disk) and
    written from there, so the wait is one batch's write plus one copy, not the whole save."""
    h = job.handle
    batch: Batch = []
    size = live = 0
    for k, (i, t, ready, _phase) in enumerate(todo):
        batch.append((i, 0, t))
        size += t.nbytes
        live += 0 if ready else t.nbytes
        if size < ZERO_COPY_BATCH and k < len(todo) - 1:
            continue
        h.staging_batches += 1
        yield batch
        h.written_live_bytes += live
        batch, size, live = [], 0, 0
        if h.waiting.is_set() and k < len(todo) - 1:
            yield from _stage_background(job, todo[k + 1 :])
            return
    h.set_staged()


def wait_staging_in_flight() -> None:
    """``loader.load``, before it writes into the live state: wait until the async save in flight
    (any, in this process) has copied the tensors it still reads (a rollback right after a save)."""
    job = _INFLIGHT
    if job is not None and not job.handle.staged():
        job.handle.wait_staged()


def _finish_previous(managed: bool = False, timeout: float | None = None) -> None:
    """One save in flight: wait for the previous one (a write of it stuck for ``timeout``: ``StuckWriteError``).
    The error of a direct ``tg.save`` nobody observed is raised by the next direct async save; a manager's
    save (``managed``) logs it and goes on, leaving it for that one (it raised it as its own failure)."""
    global _UNCOLLECTED
    with _LOCK:
        prev = _INFLIGHT
    if prev is not None:
        prev.handle.join(timeout or default_timeout())
        if prev.handle.exception() is not None and not prev.handle.observed and not prev.handle.owned:
            _UNCOLLECTED = prev.handle  # not a manager's save: that manager reports it
            if managed:
                log.warning("trainguard: an async tg.save (%s) failed: %s", prev.handle.target, prev.handle.exception())
    h, _UNCOLLECTED = _UNCOLLECTED, (_UNCOLLECTED if managed else None)
    if not managed and h is not None and not h.observed:  # result() called meanwhile: seen
        h.observed = True
        what = f"step {h.step}" if h.step is not None else h.target
        raise CheckpointError(f"the previous async save ({what}) failed: {h.exception()}") from h.exception()


# Open async CheckpointManagers of this process: the last one to close frees the staging memory.
_USERS: weakref.WeakSet[Any] = weakref.WeakSet()


def use_staging(owner: Any) -> None:
    """``CheckpointManager.open`` of an async manager: it will use the process's staging pools."""
    _USERS.add(owner)


def release_staging(owner: Any) -> None:
    """``CheckpointManager.close``, after its last save: with no save in flight, free the staging memory but the pools of
    the caps of the async managers still open (the next async save allocates it again). An ended save leaves ``_INFLIGHT`` (it held its manifest
    for the process's life: 290,000 objects for 10,000 Adam parameters), unless it failed unseen outside a manager."""
    global _INFLIGHT
    _USERS.discard(owner)
    with _LOCK:
        busy = (h := None if _INFLIGHT is None else _INFLIGHT.handle) is not None and not h.done()
        if h is not None and not busy and (h.exception() is None or h.observed or h.owned):
            _INFLIGHT = None
    if not busy:  # the pools of the caps the managers still open save with are kept
        trim_idle_pools(_USERS)


def _drain_at_exit() -> None:
    """At interpreter exit, an async save still in flight is finished, not dropped: the last
    checkpoint of a script is often the one that matters. Runs before ``concurrent.futures``
    shuts its executors down (an fsspec store's uploads may use them): registered by ``exitdrain``."""
    job = _INFLIGHT
    if job is None or job.handle.done() or job.handle.stuck:  # stuck in a write: StuckWriteError said so; not joined
        return
    h = job.handle
    what = f"of step {h.step}" if h.step is not None else f"to {h.target}"
    log.warning("trainguard: the interpreter is exiting; waiting for the async save %s to finish", what)
    try:
        h.join(h.limit)  # a write stuck for the save's timeout: the exit goes on (the thread is a daemon)
    except iostall.StuckWriteError as e:
        print(f"trainguard: the async save {what} was not committed: {e}", file=sys.stderr)
        return
    err = h.exception()
    if err is not None and not h.observed:  # printed: logging may be torn down by now
        print(f"trainguard: the async save {what} failed: {err}", file=sys.stderr)


def _pre_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Runs at the start of every ``step()`` of every optimizer (torch's global pre-hook), in the
    training thread: while the save in flight has not copied its tensors yet, waits if the
    optimizer is one of the state's or steps a tensor the save thread still has to copy (an
    optimizer not in the state, or built after the save, over the same parameters)."""
    gcpause.expire()  # the hold of a save still writing after gcpause.ASYNC_HOLD_S ends here
    job = _INFLIGHT
    if job is None or job.handle.staged():
        return
    if id(optimizer) not in job.optimizer_ids and not optimizer_writes(optimizer, job.storages):
        return
    h = job.handle
    h.hook_wait_s += h.block_until_staged()[1]


def _hook() -> None:
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_pre_step_hook)
