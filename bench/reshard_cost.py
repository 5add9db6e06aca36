"""What a resharded load costs per rank: ``python -m bench.reshard_cost ROOT KIND W W' [N [SIZE]]``.

``W`` gloo ranks on 127.0.0.1 build a state and save it under ``ROOT``; then ``W'`` fresh
ranks build the same state with other values and load it (``tg.load``, or with ``mode=mgr``
in the environment ``CheckpointManager.restore``). Each loading rank prints, for the load
alone: the bytes trainguard read (``io.counters()["bytes_read"]``), the bytes its process
read (``/proc/self/io`` ``rchar``: the manifest and index files too), its own part of the
state (the local shards' bytes), the checkpoint's data bytes, its peak extra RSS (``VmHWM``
reset through ``/proc/self/clear_refs`` just before) and the wall time. ``KIND``:

- ``fsdp``: ``N`` (default 8) square fp32 ``Linear`` layers of ``SIZE`` (default 2048), each
  ``fully_shard``-ed, and their Adam after one step (N=8, 2048: 384 MiB in all; ``fresh=1`` in
  the environment: loaded into an Adam without state, whose state the load creates);
- ``dt``: ``N`` DTensors of ``SIZE`` x 64 fp32 (default 2,000 x 64), alternately ``Shard(0)``
  and ``Shard(1)`` on a 1-D mesh (the planning cost per tensor: ``profile=1`` in the
  environment prints rank 0's cProfile of the load, top 25 by cumulative time; ``profile=tottime``
  by own time);
- ``col``/``row``: ``N`` (default 4) DTensors of ``SIZE`` x ``SIZE`` (default 4096) fp32, ``Shard(1)``
  (column shards: resharded, read through scratch) or ``Shard(0)``.

The save is skipped when ``ROOT/KIND-W-N-SIZE`` exists. Example: ``python -m bench.reshard_cost
/tmp/rc fsdp 4 3``. Compare with another commit with ``PYTHONPATH=<its worktree>/src``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from typing import Any

from bench.optim_load_rss import _status  # MiB of a /proc/self/status field


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _state(kind: str, n: int, size: int, world: int, seed: int) -> dict[str, Any]:
    import torch

    import trainguard as tg

    torch.manual_seed(seed)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(*[torch.nn.Linear(size, size, bias=False) for _ in range(n)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters())
        if seed == 0 or not os.environ.get("fresh"):  # fresh=1: load into an Adam without state
            model(torch.ones(2, size)).sum().backward()
            opt.step()
        return {"model": model, "optim": opt}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    cols, dim = (64, None) if kind == "dt" else (size, 1 if kind == "col" else 0)
    d = {f"t{i}": distribute_tensor(torch.randn(size, cols, generator=g), mesh, [Shard(i % 2 if dim is None else dim)])
         for i in range(n)}
    return {"w": tg.StateDict(d)}


def _local_bytes(state: dict[str, Any]) -> int:
    import torch

    seen: dict[int, Any] = {}  # the tensors themselves, so that no id is reused

    def add(t: Any) -> None:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            seen.setdefault(t.untyped_storage().data_ptr() if t.nbytes else id(t), t)

    for v in state.values():
        if isinstance(v, torch.nn.Module):
            for t in v.state_dict().values():
                add(t)
        elif isinstance(v, torch.optim.Optimizer):
            for s in v.state.values():
                for t in s.values():
                    add(t)
        else:
            for t in v.values():
                add(t)
    return sum(t.nbytes for t in seen.values())


def _worker(rank: int, world: int, port: int, root: str, phase: str, kind: str, n: int, size: int) -> None:
    import torch.distributed as dist

    import trainguard as tg
    from trainguard import io

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = _state(kind, n, size, world, 0 if phase == "save" else 1)
    mgr = os.environ.get("mode") == "mgr"
    if phase == "save":
        if mgr:
            with tg.CheckpointManager(root) as m:
                m.save(1, state, force=True)
        else:
            tg.save(f"{root}/ck", state)
        dist.destroy_process_group()
        return
    import gc

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base, r0, b0, t0 = _status("VmRSS"), _rchar(), io.counters()["bytes_read"], time.perf_counter()
    prof = None
    if os.environ.get("profile") and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mgr:
            with tg.CheckpointManager(root) as m:
                m.restore(state)
        else:
            tg.load(f"{root}/ck", state)
    dt = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    read, rchar, peak = io.counters()["bytes_read"] - b0, _rchar() - r0, _status("VmHWM") - base
    mine = _local_bytes(state)
    ck = root if mgr else f"{root}/ck"
    data = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs)
    M = 2**20
    print(f"{kind} W'={world} rank {rank}: own {mine / M:.1f} MiB, trainguard read {read / M:.1f} MiB "
          f"(x{read / max(mine, 1):.2f} own), rchar {rchar / M:.1f} MiB, checkpoint {data / M:.1f} MiB, "
          f"peak extra RSS {peak:.1f} MiB, {dt:.3f} s", flush=True)
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime" if os.environ["profile"] == "tottime" else "cumulative").print_stats(25)
    dist.destroy_process_group()


def _spawn(world: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_worker, args=(world, port, *args), nprocs=world)


def main() -> None:
    root, kind, w, w2 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    n = int(sys.argv[5]) if len(sys.argv) > 5 else {"fsdp": 8, "dt": 2000}.get(kind, 4)
    size = int(sys.argv[6]) if len(sys.argv) > 6 else {"fsdp": 2048, "dt": 64}.get(kind, 4096)
    d = os.path.join(root, f"{kind}-{w}-{n}-{size}" + ("-mgr" if os.environ.get("mode") == "mgr" else ""))
    if not os.path.exists(d):
        os.makedirs(d)
        _spawn(w, d, "save", kind, n, size)
    _spawn(w2, d, "load", kind, n, size)


if __name__ == "__main__":
    main()
