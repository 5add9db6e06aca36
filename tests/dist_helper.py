"""Run a function on W real ranks (gloo on 127.0.0.1) and report every rank's outcome.

``run_ranks(fn, world, *args, timeout=60, env={...})`` starts ``world`` processes, each of
which joins a gloo process group whose rendezvous is a TCPStore hosted by the calling (test)
process on a free port, runs ``fn(rank, world, *args)`` and sends back its return value or its
traceback. Ranks still running at ``timeout`` are killed by PID (SIGKILL) and reported as
timed out; a rank that died reports its exit code (-9 for SIGKILL). Nothing is left running.

Processes come from a *forkserver* that imported torch (with torch._dynamo, which building an
optimizer imports), trainguard and pytest once, so a group of 2 ranks starts in about a second
instead of re-importing them in every rank. ``fn`` must be a module-level
function of an importable module (a test module is fine).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

_MP: Any = None


def _context() -> Any:
    """The forkserver context of this process (started at its first ``Process``). Its children get the environment
    the forkserver had when it started, not the test's ``os.environ`` now: what a test set since (AWS_* of the
    ``weed`` fixture, a monkeypatched variable) reaches them only when passed (``run_ranks(env=...)``, or an argument
    the child applies)."""
    global _MP
    if _MP is None:
        _MP = mp.get_context("forkserver")
        # What nearly every rank imports anyway, once here instead of in every rank: torch._dynamo
        # (the first optimizer built imports it, with torch.distributed.tensor/fsdp, sympy: seconds
        # of CPU per rank), trainguard and pytest (test modules import them).
        _MP.set_forkserver_preload(["torch", "torch.distributed", "numpy", "numpy.random", "torch._dynamo", "trainguard", "pytest"])
    return _MP


@dataclass
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None  # traceback text when fn raised
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


class RanksFailed(AssertionError):
    pass


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return each rank's result.

    With ``check`` (default), raise ``RanksFailed`` with every failing rank's traceback and
    exit code unless all ranks returned normally.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    out = Path(tempfile.mkdtemp(prefix="tg-ranks-"))
    ctx = _context()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, store.port, str(out), dict(env or {}), args, timeout))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # by PID: only the processes this helper started
                p.join(5)
    for r, p in enumerate(procs):
        res = RankResult(r, p.exitcode, timed_out=p.exitcode == -9 and time.monotonic() >= deadline)
        f = out / f"{r}.pkl"
        if f.exists():
            kind, payload = pickle.loads(f.read_bytes())
            if kind == "ok":
                res.value = payload
            else:
                res.error = payload
        results.append(res)
        p.close()
    shutil.rmtree(out, ignore_errors=True)  # the ranks' result files: read above (it left one directory per call)
    del store
    if check and not all(r.ok for r in results):
        raise RanksFailed(describe(results))
    return results


def describe(results: list[RankResult]) -> str:
    lines = []
    for r in results:
        state = "timed out (killed)" if r.timed_out else f"exit code {r.exitcode}"
        lines.append(f"--- rank {r.rank}: {state}")
        if r.error:
            lines.append(r.error)
    return "\n".join(lines)


def _child(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: str, env: dict[str, str], args: tuple, timeout: float
) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world), str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    code = 0
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        # Every rank's mesh is up before any runs fn: a rank whose fn ends at once (an argument refused)
        # exited while a peer was still in connectFullMesh ("Connection closed by peer", CI of 2026-12-04).
        dist.barrier()
        value = fn(rank, world, *args)
        payload = ("ok", value)
    except BaseException:
        payload = ("error", traceback.format_exc())
        code = 1
    tmp = Path(out) / f"{rank}.tmp"
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(Path(out) / f"{rank}.pkl")
    # Skip interpreter teardown (gloo/store threads can make it slow); results are on disk.
    os._exit(code)


def attempt(fn: Callable[[], Any]) -> dict:
    """Run ``fn`` on a rank and return its outcome for the test to compare across ranks:
    ``{"type": None}``, ``{"type": "RankFailureError", "msg", "ranks"}`` (the ranks it names),
    or ``{"type": <exception class name>, "msg"}``."""
    import trainguard as tg

    try:
        fn()
    except tg.RankFailureError as e:
        return {"type": "RankFailureError", "msg": str(e), "ranks": sorted(e.failures)}
    except Exception as e:  # noqa: BLE001 - reported to the test as a wrong outcome
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """Every parameter and optimizer state tensor, whole (collective for DTensors)."""

    def whole(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()

    out = {f"p/{n}": whole(p.detach()) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"o/{names[id(p)]}/{k}"] = whole(v)
    return out


def cpu_mesh() -> Any:
    """The 1-D CPU device mesh over the default group, for ``fully_shard(..., mesh=cpu_mesh())``
    in these gloo tests. Without a mesh, fully_shard takes one on the accelerator
    (``torch._C._get_accelerator()``): on a GPU machine both ranks' shards went to cuda:0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def small_model(kind: str, seed: int) -> Any:
    """A 3-layer MLP (its last layer 7 rows: uneven over 2 ranks), ``fully_shard``-ed per layer
    when ``kind == "fsdp"`` (inside a rank's process group), else plain (DDP-style replicated)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 7))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=cpu_mesh())
        fully_shard(m, mesh=cpu_mesh())
    return m
