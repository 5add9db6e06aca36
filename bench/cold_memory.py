"""Why a buffered cold read can beat O_DIRECT in ``bench.run`` and lose to it in a restart:
``python -m bench.cold_memory [--gb 3] [--rounds 3] [--idle 20]`` (root: drops the page cache).

One file of ``--gb`` GiB is read into one existing buffer by 2 threads in 32 MiB ``preadv``
calls, three ways per round: (a) buffered, right after ``drop_caches`` freed a cached copy of
the same file (what ``bench.run``'s cold loads see: the cache is dropped right after the hot
loads); (b) buffered, ``--idle`` seconds after the drop (the freed memory has sat idle, as on a
node where a job restarts); (c) O_DIRECT (no page cache). On this VM the buffered read was fast
only with memory freed moments before; why is not known (first-touching fresh anonymous
memory costs the same right after a free and after 20 s idle, ~2.2 us a page: README).
Prints each read's wall time, then every variant's figures. The file is deleted at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from pathlib import Path

PIECE = 32 << 20
REPO = Path(__file__).resolve().parent.parent


def _drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _read(path: Path, size: int, dest: memoryview, *, direct: bool, threads: int = 2) -> float:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    offsets = iter(range(0, size, PIECE))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                o = next(offsets, None)
            if o is None:
                return
            os.preadv(fd, [dest[o : o + PIECE]], o)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(prog="python -m bench.cold_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=3.0, help="file size in GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=float, default=20.0, help="seconds between the drop and read (b)")
    a = p.parse_args(argv)
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise SystemExit("bench.cold_memory needs root (it writes /proc/sys/vm/drop_caches)")
    size = int(a.gb * (1 << 30)) // PIECE * PIECE
    path = REPO / "bench" / ".tmp" / "cold_memory.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, size)
    dest = memoryview(buf)
    dest[:: mmap.PAGESIZE] = b"\1" * (size // mmap.PAGESIZE)  # touched once: no fault in the timing
    names = ("buffered, right after the drop of a cached copy", f"buffered, {a.idle:g} s after the drop", "O_DIRECT")
    res: dict[str, list[float]] = {n: [] for n in names}
    try:
        with open(path, "wb") as f:
            block = os.urandom(PIECE)
            for _ in range(size // PIECE):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        for rnd in range(a.rounds):
            _read(path, size, dest, direct=False)  # the file is in the page cache
            _drop()
            t_a = _read(path, size, dest, direct=False)
            _drop()
            time.sleep(a.idle)  # the condition measured, not a synchronisation
            t_b = _read(path, size, dest, direct=False)
            _drop()
            t_c = _read(path, size, dest, direct=True)
            for n, t in zip(names, (t_a, t_b, t_c)):
                res[n].append(t)
            print(f"round {rnd}: " + "  ".join(f"{t:.3f} s" for t in (t_a, t_b, t_c)), flush=True)
    finally:
        path.unlink(missing_ok=True)
    print(f"{size / 2**30:.2f} GiB, 2 threads, {PIECE >> 20} MiB reads:")
    for n, v in res.items():
        print(f"  {n}: " + ", ".join(f"{t:.2f}" for t in v) + " s")
    return res


if __name__ == "__main__":
    main()
