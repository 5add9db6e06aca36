"""Time of ``tg.verify`` (``trainguard verify``) of one checkpoint on an object store, optionally behind a proxy
that adds a round trip's latency to each request.

``python -m bench.verify_store make URL {tensors,ranks}`` writes the checkpoint ``URL``:
``tensors``, one rank file of 4,000 tensors of 16 KiB (64 MB); ``ranks``, a 4-rank save (gloo on 127.0.0.1,
``tests/dist_helper.run_ranks``) of 16 tensors of 16 MiB: 4 rank files of 64 MiB.

``python -m bench.verify_store time URL [--reps 3] [--rtt-ms 0]`` prints the seconds of each ``tg.verify(URL)``
(after one untimed warm-up), its result's ``ok``, ``bytes_checked`` and errors. ``--rtt-ms``: through a proxy on
127.0.0.1 that holds back the first bytes of each request and of each answer by half of it.

The store is the one the boto environment names (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...): a SeaweedFS
server on 127.0.0.1 as the tests start it (``tests/test_storage_s3.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse


def _ranks_state(rank: int, world: int, url: str) -> None:
    import torch

    import trainguard as tg

    torch.manual_seed(0)
    tg.save(url, {f"t{i}": torch.randn(4 << 20) for i in range(16)})


def make(url: str, kind: str) -> None:
    import torch

    import trainguard as tg

    if kind == "tensors":
        torch.manual_seed(0)
        tg.save(url, {f"t{i:04d}": torch.randn(4096) for i in range(4000)})
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from dist_helper import run_ranks

        out = run_ranks(_ranks_state, 4, url, timeout=600)
        print(out)


class DelayProxy:
    """127.0.0.1:<port> -> ``upstream``; each burst of bytes in one direction after the other's is held back by
    ``delay`` seconds (half a round trip each way: a request, then its answer)."""

    def __init__(self, host: str, upstream: int, delay: float) -> None:
        self.host, self.upstream, self.delay = host, upstream, delay
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(self.host, self.upstream)
        last = [""]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, d: str) -> None:
            try:
                while data := await r.read(1 << 20):
                    if last[0] != d:
                        last[0] = d
                        await asyncio.sleep(self.delay)
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(cr, uw, "up"), pipe(ur, cw, "down"))


def time_verify(url: str, reps: int, rtt_ms: float) -> None:
    if rtt_ms:
        ep = urlparse(os.environ["AWS_ENDPOINT_URL"])
        proxy = DelayProxy(ep.hostname or "127.0.0.1", ep.port or 80, rtt_ms / 2000)
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
    import trainguard as tg

    res = tg.verify(url)  # warm-up: imports, connections
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = tg.verify(url)
        times.append(time.perf_counter() - t0)
    print(f"{url} rtt={rtt_ms:g}ms ok={res.ok} bytes={res.bytes_checked} errors={res.errors[:3]} "
          f"times={[round(t, 2) for t in times]} median={statistics.median(times):.2f}s")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("url")
    m.add_argument("kind", choices=["tensors", "ranks"])
    t = sub.add_parser("time")
    t.add_argument("url")
    t.add_argument("--reps", type=int, default=3)
    t.add_argument("--rtt-ms", type=float, default=0.0)
    a = p.parse_args()
    if a.cmd == "make":
        make(a.url, a.kind)
    else:
        time_verify(a.url, a.reps, a.rtt_ms)


if __name__ == "__main__":
    main()
