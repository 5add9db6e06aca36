"""torch.distributed.checkpoint (DCP): synchronous save/load and async_save variants.

On CPU (torch 2.13), pinned-memory staging is ignored with a warning, and
``FileSystemWriter(cache_staged_state_dict=True)`` / ``DefaultStager()`` with default options
raise because they want an accelerator, so the "best" async variants use a reused
``DefaultStager`` with explicit :class:`StagingOptions` (pinned, shared memory and non-blocking
copies off). With several ranks, DCP dedups the replicated tensors and spreads the writes.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .base import AsyncHandle, Ctx, LoadVariant, SyncMethod
from .base import AsyncMethod as _Async
from .states import State


def _save(threads: int):
    def save(ctx: Ctx, d: Path, state: State) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(str(d), thread_count=threads), process_group=ctx.pg)
    return save


def load_in_place(ctx: Ctx, d: Path, state: State) -> None:
    dcp.load(state, storage_reader=FileSystemReader(str(d)), process_group=ctx.pg)


def _sync(threads: int) -> SyncMethod:
    return SyncMethod(
        name=f"dcp_t{threads}",
        label=f"DCP save (thread_count={threads})",
        save=_save(threads),
        loads=(LoadVariant("dcp.load", load_in_place, True, "dcp.load into the existing tensors"),),
        how=f"dcp.save with FileSystemWriter(thread_count={threads}, sync_files=True)",
        multi_rank="every rank saves its share (replicated tensors deduplicated); every rank loads all",
    )


DCP_T1 = _sync(1)
DCP_T2 = _sync(2)


class _FutureHandle:
    """async_save returned a plain Future: staging finished inside the call."""

    def __init__(self, fut: Future) -> None:
        self._fut = fut

    def staged(self) -> bool:
        return True

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> None:
        self._fut.result(timeout=timeout)


class _ResponseHandle:
    """async_save returned an AsyncSaveResponse: staging runs in a background thread."""

    def __init__(self, resp: dcp.state_dict_saver.AsyncSaveResponse) -> None:
        self._resp = resp

    def staged(self) -> bool:
        return self._resp.staging_completion.done()

    def done(self) -> bool:
        return self._resp.upload_completion.done()

    def result(self, timeout: float | None = None) -> None:
        self._resp.staging_completion.result(timeout=timeout)
        self._resp.upload_completion.result(timeout=timeout)


def _wrap(out: object) -> AsyncHandle:
    if isinstance(out, Future):
        return _FutureHandle(out)
    return _ResponseHandle(out)  # type: ignore[arg-type]


def _start_default(ctx: Ctx, d: Path, state: State) -> AsyncHandle:
    return _wrap(dcp.async_save(state, checkpoint_id=str(d), process_group=ctx.ckpt_pg))


def _stager(ctx: Ctx, background: bool) -> DefaultStager:
    key = f"dcp_stager:{background}"
    if key not in ctx.cache:
        ctx.cache[key] = DefaultStager(StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=background,
            use_non_blocking_copy=False,
        ))
    return ctx.cache[key]


def _start_reused(background: bool):
    def start(ctx: Ctx, d: Path, state: State) -> AsyncHandle:
        out = dcp.async_save(
            state,
            storage_writer=FileSystemWriter(str(d), thread_count=2),
            process_group=ctx.ckpt_pg,
            async_stager=_stager(ctx, background),
        )
        return _wrap(out)
    return start


def _close_stager(background: bool):
    def close(ctx: Ctx) -> None:
        stager = ctx.cache.pop(f"dcp_stager:{background}", None)
        if stager is not None:
            stager.close()
    return close


DCP_ASYNC = _Async(
    name="dcp_async",
    label="DCP async_save (default)",
    start=_start_default,
    load=load_in_place,
    how="dcp.async_save(state, checkpoint_id=dir): its internal stager copies into fresh CPU memory "
        "inside the call, then one thread writes (thread_count=1) and fsyncs",
)

DCP_ASYNC_REUSE = _Async(
    name="dcp_async_reuse",
    label="DCP async_save (reused stager)",
    start=_start_reused(False),
    load=load_in_place,
    how="async_save with one DefaultStager(StagingOptions(all False)) reused across saves (its "
        "cached buffers are copied into inside the call) and FileSystemWriter(thread_count=2)",
    close=_close_stager(False),
)

DCP_ASYNC_BG = _Async(
    name="dcp_async_bgstage",
    label="DCP async_save (reused stager, background staging)",
    start=_start_reused(True),
    load=load_in_place,
    how="as dcp_async_reuse but use_async_staging=True: the copy runs in a thread; training waits "
        "for staging_completion before mutating",
    close=_close_stager(True),
)
