"""Peak extra RSS of loading a fresh FSDP2 Adam: ``python -m bench.optim_load_rss [LAYERS WIDTH]``.

Two gloo ranks on 127.0.0.1 build ``LAYERS`` square fp32 linear layers of ``WIDTH`` (default 4
and 2048), each ``fully_shard``-ed, take one Adam step and save; two fresh ranks build the same
model with a fresh Adam (no state) and load it. Each loading rank prints its optimizer state's
local size and its peak extra RSS during the load (``VmHWM`` reset through ``/proc/self/clear_refs``
just before). To compare with an older commit, run it with ``PYTHONPATH=<its worktree>/src``
(docs/distributed.md, "Optimizer state of DTensor parameters").
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(rank: int, world: int, port: int, root: str, phase: str, layers: int, width: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import trainguard as tg

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    if phase == "save":
        model(torch.ones(2, width)).sum().backward()
        opt.step()
        tg.save(f"{root}/ck", {"model": model, "optim": opt})
    else:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _status("VmRSS")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tg.load(f"{root}/ck", {"model": model, "optim": opt})
        local = sum(t.to_local().nbytes for s in opt.state.values() for t in s.values() if hasattr(t, "to_local"))
        print(f"rank {rank}: optimizer state {local / 2**20:.0f} MiB local, peak extra RSS {_status('VmHWM') - base:.0f} MiB",
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    args = sys.argv[1:]
    layers, width = (int(args[0]), int(args[1])) if len(args) >= 2 else (4, 2048)
    root = tempfile.mkdtemp(prefix="tg-optim-rss-")
    for phase in ("save", "load"):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_worker, args=(2, port, root, phase, layers, width), nprocs=2)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
