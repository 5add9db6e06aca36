"""The training loop that measures an async save's stall.

One step = ``compute()`` (a fixed number of matmuls into preallocated outputs, calibrated once
to take ``step_seconds``; it reads no parameter, like forward/backward) followed by the
"optimizer step", which mutates every state tensor in place (element 0 := step number).

Timeline: steps 1..3 run without a save (their median compute time is the baseline); right after
step 3's mutation the save starts. Each later step computes, then waits until the handle says
``staged()``, then mutates. The loop continues until the save is done (bounded by a deadline).

- stall   = time inside the save call + time waiting for ``staged()`` before the next mutation
- slowdown = sum over in-flight steps of (compute time - baseline): CPU stolen from training
- latency = from the call until ``result()`` returned and the files are fsynced (durable)
Afterwards the checkpoint is loaded in place and must hold step 3's values (consistency check).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .base import AsyncMethod, Ctx
from .measure import Deadline, PeakMeter, fsync_tree
from .states import State, check_marks, mark

_N = 512
_PRE_STEPS = 3


class Trainer:
    def __init__(self, step_seconds: float) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(_N, _N, generator=g)
        self.b = torch.randn(_N, _N, generator=g) / _N
        self.c = torch.empty(_N, _N)
        self.k = 4
        self.compute()  # warm-up: thread pool start, first-touch of the outputs
        one = min(self.compute() for _ in range(3)) / 4
        self.k = max(1, round(step_seconds / max(one, 1e-6)))
        self.calibrated_step_s = self.k * one

    def compute(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.k):
            torch.mm(self.a, self.b, out=self.c)
        return time.perf_counter() - t0


def _wait_staged(handle, deadline: Deadline) -> float:
    t0 = time.perf_counter()
    while not handle.staged():
        if deadline.expired():
            raise TimeoutError("async save not staged before the deadline")
        time.sleep(0.0005)
    return time.perf_counter() - t0


def run_async(ctx: Ctx, m: AsyncMethod, state: State, d: Path, trainer: Trainer, timeout_s: float) -> dict:
    names = list(state)
    pre = []
    for step in range(1, _PRE_STEPS + 1):
        pre.append(trainer.compute())
        mark(state, float(step))
    base = statistics.median(pre)
    ctx.barrier()
    deadline = Deadline(timeout_s)
    wait_s = slowdown = 0.0
    in_flight = 0
    step = _PRE_STEPS
    with PeakMeter() as pm:
        t0 = time.perf_counter()
        handle = m.start(ctx, d, state)
        call_s = time.perf_counter() - t0
        while True:
            step += 1
            ct = trainer.compute()
            wait_s += _wait_staged(handle, deadline)
            mark(state, float(step))
            in_flight += 1
            slowdown += max(0.0, ct - base)
            if handle.done() or deadline.expired():
                break
        handle.result(timeout=max(1.0, deadline.left()))
        ctx.barrier()
        if ctx.rank == 0:
            fsync_tree(d)
        ctx.barrier()
        latency = time.perf_counter() - t0
    mark(state, -1.0)
    ctx.barrier()
    m.load(ctx, d, state)
    problem = check_marks(state, names, float(_PRE_STEPS))
    return {
        "stall_s": call_s + wait_s, "call_s": call_s, "wait_s": wait_s, "latency_s": latency,
        "slowdown_s": slowdown, "steps_in_flight": in_flight, "base_step_s": base,
        "peak_extra": pm.extra, "consistent": problem is None, "problem": problem,
    }
