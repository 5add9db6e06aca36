"""What ``replicas.digests`` costs a later save (the moving window of tensor heads) next to a first
save, in one process without a process group: an SGD-with-momentum state of 10,000 replicated tensors
of 1 KiB, and of 400 of 4 MiB (docs/distributed.md, "Replicas that differ").

    PYTHONPATH=src python -m bench.replica_window
"""

from __future__ import annotations

import time

import torch
from torch import nn

from trainguard import replicas
from trainguard.capture import capture


class _Ctx:
    """What ``capture`` reads of a 2-rank context."""

    world_size, rank, is_distributed = 2, 0, True


def main() -> None:
    for n, width in ((10_000, 16), (400, 1024)):
        model = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n // 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        state = {"model": model, "optim": opt}
        leaves = capture(state, ctx=_Ctx()).leaves  # type: ignore[arg-type]
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            replicas.digests(state, leaves, 2, f"sig-{n}", "sharded")
            times.append(time.perf_counter() - t0)
        print(f"{len(leaves)} replicated tensors of {width * width * 4} B: first save {times[0] * 1e3:.1f} ms, "
              f"later saves {min(times[1:]) * 1e3:.2f}-{max(times[1:]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
