"""Rank 0's cost of cleaning up finished collective rounds at a large world size, without a
process group: ``python -m bench.cleanup_cost [--world 512] [--rounds 5]``.

One ``StoreDistContext`` (rank 0 of ``--world``) on a loopback ``TCPStore``; for each round the
keys a gathering round leaves (``world + 1``) are created, then ``forget`` is timed (what
rank 0's collective waits for), and at the end the time until the background deletion is
done (``BoundedStore.drain``) and the keys left over.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch.distributed as dist

from trainguard.dist import StoreDistContext


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cleanup_cost", description=__doc__)
    ap.add_argument("--world", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
    ctx = StoreDistContext(client, 0, a.world, dead_after_s=30)
    names = [*range(a.world), "all"]
    try:
        ts = []
        for r in range(1, a.rounds + 1):
            for k in names:
                client.set(f"{ctx.chan}/r1.{r}/begin/{k}", "v")
            ctx._keys[(1, r)] = ("begin", True, True)  # operation 1, round r
            t = time.perf_counter()
            ctx.forget((1, r))
            ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        ctx.store.drain()
        drained = time.perf_counter() - t
        left = sum(client.check([f"{ctx.chan}/r1.{r}/begin/{k}"]) for r in range(1, a.rounds + 1) for k in names)
    finally:
        ctx.close()
    print(f"world {a.world}: rank 0's cleanup per round " + " ".join(f"{x * 1e3:.1f}" for x in ts)
          + f" ms; background deletion done {drained * 1e3:.0f} ms later; keys left {left}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
