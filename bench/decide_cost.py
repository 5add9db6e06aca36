"""Per-step cost of ``CheckpointManager.save`` on a step that saves nothing, on 2 gloo ranks:
``python -m bench.decide_cost [SRC]`` (SRC: a trainguard ``src`` directory to measure, e.g. an
older commit's worktree; default this checkout's).

Each rank is a subprocess on 127.0.0.1 (bounded by a timeout); after 200 warm-up steps each
times 3,000 ``mgr.save(step, state)`` calls of ``EveryNSteps(10**9)`` with signal handling on
(the default), i.e. the manager's per-step "decide" broadcast through the c10d store, and
prints its microseconds per step.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 3000


def _rank(rank: int, port: str, root: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import trainguard as tg

    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10**9)) as m:
        for s in range(1, 201):
            m.save(s, state)
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(201, 201 + STEPS):
            m.save(s, state)
        print(f"rank {rank}: {(time.perf_counter() - t0) / STEPS * 1e6:.1f} us per step", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[str]:
    args = sys.argv[1:] if argv is None else argv
    src = args[0] if args else str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, PYTHONPATH=src)
    port = str(random.randrange(20000, 40000))
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-c", "import sys; from bench.decide_cost import _rank; _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3])"]
        env["PYTHONPATH"] = os.pathsep.join([src, str(Path(__file__).resolve().parent.parent)])
        procs = [subprocess.Popen([*cmd, str(r), port, root], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        lines = []
        for p in procs:
            try:
                out = p.communicate(timeout=120)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0] + "\ntimed out"
            lines += [ln for ln in out.splitlines() if ln.endswith("per step")] or [out.strip()[-300:]]
    for ln in lines:
        print(f"{src}: {ln}")
    return lines


if __name__ == "__main__":
    main()
