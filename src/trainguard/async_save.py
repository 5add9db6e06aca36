"""Asynchronous saving: capture now, copy tensors to host buffers, write and commit in the
background. One save in flight per process; errors surface at the next save/wait/close.

Called by ``api.start_save(async_=True)`` on every rank, from the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from .api import Leaf, _collective_capture, chunk_view, persist_and_commit
from .dist import DistContext
from .handle import SaveHandle
from .planner import Box
from .storage import Storage


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
) -> SaveHandle:
    snap = _collective_capture(state, ctx, layout, timeout)
    # Stage: host copies of every tensor, so training may mutate the originals right away.
    copies = {id(lf): lf.tensor.detach().to("cpu", copy=True) for lf in snap.leaves}
    handle = SaveHandle(step)
    handle.set_staged()

    def stage(lf: Leaf, box: Box) -> torch.Tensor:
        staged = Leaf(lf.path, copies[id(lf)], lf.dtype, lf.shape, lf.box, lf.kind, lf.writer)
        return chunk_view(staged, box)

    def run() -> None:
        try:
            m = persist_and_commit(
                storage, target, snap, ctx, layout=layout, metadata=metadata, overwrite=overwrite,
                timeout=timeout, stage=stage, step=step,
            )
            handle.set_result(m)
        except BaseException as e:  # surfaced by handle.result()
            handle.set_error(e)
        finally:
            copies.clear()

    threading.Thread(target=run, name="trainguard-async-save", daemon=True).start()
    return handle
