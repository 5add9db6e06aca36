"""What the replicas check (replicas.py) adds to an async save's call, the training stall: 2 gloo
ranks, an MLP of BatchNorm'd Linear layers with AdamW after one step (parameters + 2 moments: the
replicated state is 3x the parameters), saved async three times: the first save hashes every
replicated tensor, the later ones the module buffers alone; the same with the check off
(``replicas.digests`` returning None). Prints each save's ``handle.call_s`` (median of both ranks'
max) and the digest time measured alone (docs/distributed.md, "Replicas that differ").

    PYTHONPATH=src python -m bench.replica_digest [MB of replicated state ...]   (default 100 1000)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _rank(rank: int, world: int, root: str, mb: int, check: bool) -> dict:
    import torch
    from torch import nn

    import trainguard as tg
    from trainguard import replicas

    if not check:
        replicas.digests = lambda *a, **k: None  # type: ignore[assignment]
        import trainguard.capture as cap
        cap.digests = replicas.digests  # type: ignore[attr-defined]
    width = 2048
    layers = max(1, round(mb * 2**20 / 3 / 4 / (width * width)))  # 3 copies (weight, exp_avg, exp_avg_sq) of float32
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.BatchNorm1d(width))]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    calls = []
    for step in (1, 2, 3):
        h = tg.save(f"{root}/{int(check)}-{mb}/step-{step:09d}", state, async_=True)
        calls.append(h.call_s)
        h.result()
    t0 = time.perf_counter()
    replicas._SEEN.clear()
    if check:
        from trainguard.capture import capture
        from trainguard.dist import DistContext
        capture(state, ctx=DistContext.current())
    alone = time.perf_counter() - t0
    nbytes = sum(p.nbytes for p in model.parameters()) * 3
    return {"calls": calls, "alone": alone, "mb": nbytes / 2**20}


def main() -> None:
    from dist_helper import run_ranks

    sizes = [int(a) for a in sys.argv[1:]] or [100, 1000]
    for mb in sizes:
        for check in (False, True):
            with tempfile.TemporaryDirectory() as root:
                res = run_ranks(_rank, 2, root, mb, check, timeout=600)
            calls = [max(r.value["calls"][i] for r in res) for i in range(3)]
            print(f"{res[0].value['mb']:.0f} MB replicated, check {'on ' if check else 'off'}: call_s first "
                  f"{calls[0]:.3f}, then {calls[1]:.3f}, {calls[2]:.3f}"
                  + (f"; capture with every tensor hashed, alone: {max(r.value['alone'] for r in res):.3f} s" if check else ""),
                  flush=True)


if __name__ == "__main__":
    main()
