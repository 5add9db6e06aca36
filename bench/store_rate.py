"""How many calls per second one c10d ``TCPStore`` server answers with many clients: ``python -m
bench.store_rate [--clients 16,64,256] [--procs 8] [--secs 3] [--op add|check]``.

The server is a ``TCPStore(is_master=True)`` in this process (torch's default backend), as under
torchrun's agent or rank 0 with ``env://``. ``--procs`` subprocesses each open ``clients / procs``
client connections, one thread each, and call ``op`` in a loop (``add``: a heartbeat, each client its
own key; ``check``: a waiting rank's poll of one key) until the deadline; the total calls answered
per second is printed. The clients run on the same machine as the server: on a small machine the
number is what the machine's cores allow clients and server together, a lower bound on the server's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path


def _client(port: int, threads: int, secs: float, op: str, tag: str) -> None:
    import threading

    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)) for _ in range(threads)]
    counts = [0] * threads
    start = time.monotonic() + 0.5  # every connection made first
    end = start + secs

    def run(i: int) -> None:
        s, key = stores[i], f"rate/{tag}/{i}"
        s.set(key, "0")
        while time.monotonic() < start:
            time.sleep(0.01)
        n = 0
        while time.monotonic() < end:
            if op == "add":
                s.add(key, 1)
            else:
                s.check([key])
            n += 1
        counts[i] = n

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(secs + 60)
    print(sum(counts), flush=True)


def rate(clients: int, procs: int, secs: float, op: str) -> float:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    procs = min(procs, clients)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", "import sys; from bench.store_rate import _client; a = sys.argv[1:]; "
           "_client(int(a[0]), int(a[1]), float(a[2]), a[3], a[4])"]
    ps = [subprocess.Popen([*cmd, str(server.port), str(clients // procs + (i < clients % procs)), str(secs), op, str(i)],
                           env=env, stdout=subprocess.PIPE, text=True) for i in range(procs)]
    total = 0
    try:
        for p in ps:
            out = p.communicate(timeout=secs + 120)[0]
            total += int(out.strip().splitlines()[-1])
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    del server
    return total / secs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="16,64,256")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--op", default="add", choices=["add", "check"])
    a = ap.parse_args(argv)
    for n in (int(x) for x in a.clients.split(",")):
        print(f"{n} clients in {min(a.procs, n)} processes, {a.op}: {rate(n, a.procs, a.secs, a.op):,.0f} calls/s", flush=True)


if __name__ == "__main__":
    main()
