"""Rank 0's wait for a round with one rank late, at scale: ``python -m bench.store_wait [--world 1024] [--late 5]``
(trainguard from ``PYTHONPATH``: put an older commit's ``src`` first to measure it).

One process: a ``TCPStore`` server and one client, counted (calls; bytes of keys and values sent, values
received). The store holds what a job's would while rank 0 waits in a save's "begin": every rank's heartbeat
(bumped every 0.5 s) and "where am I" key, and every rank's answer but one, set ``--late`` seconds in.
``distwait.wait_for`` runs as rank 0 with keys named as in a job. Prints the wait's store calls and bytes.
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta


def _nbytes(v: object) -> int:
    if isinstance(v, (str, bytes)):
        return len(v)
    return sum(_nbytes(x) for x in v) if isinstance(v, list) else 8


def main(argv: list[str] | None = None) -> tuple[int, int]:
    import torch.distributed as dist

    from trainguard import distwait
    from trainguard.storecall import BoundedStore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--late", type=float, default=5.0)
    a = ap.parse_args(argv)
    world, late = a.world, a.world // 2 + 1
    srv = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    cli = dist.TCPStore("127.0.0.1", srv.port, 1, False, timeout=timedelta(seconds=30))
    count = [0, 0]

    class Counting:
        def __getattr__(self, name: str) -> object:
            fn = getattr(cli, name)

            def call(*args: object) -> object:
                out = fn(*args)
                count[0] += 1
                count[1] += sum(_nbytes(x) for x in args) + (_nbytes(out) if name in ("get", "multi_get") else 0)
                return out

            return call

    chan, key = "trainguard/0/main", "trainguard/0/main/r12.1/begin/{}"
    for r in range(world):
        srv.add(f"trainguard/0/hb/{r}", 1)
        srv.set(f"{chan}/at/{r}", '[12, 0, "(busy) capture"]' if r == late else '[12, 1, "begin"]')
        if r != late:
            srv.set(key.format(r), "{}")

    class Ctx:
        rank, world_size, dead_after, prefix, _op, _round, _parent = 0, world, 30.0, "trainguard/0", 12, 1, None
        store = BoundedStore(Counting(), 30.0)

    Ctx.chan = chan
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.5):
            for r in range(world):
                srv.add(f"trainguard/0/hb/{r}", 1)

    threading.Thread(target=beat, daemon=True).start()
    timer = threading.Timer(a.late, lambda: srv.set(key.format(late), "{}"))
    timer.start()
    t0 = time.monotonic()
    distwait.wait_for(Ctx(), [key.format(r) for r in range(world)], list(range(world)), "begin", 600.0)
    stop.set()
    timer.join()
    print(f"world {world}, rank {late} late by {a.late:g} s: rank 0 waited {time.monotonic() - t0:.2f} s, "
          f"{count[0]} store calls, {count[1]:,} bytes")
    return count[0], count[1]


if __name__ == "__main__":
    main()
