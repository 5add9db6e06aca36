"""Restart-to-restored time from the RAM tier vs from disk.

    python -m bench.ram_tier --size-gb 0.2            # quick
    python -m bench.ram_tier --size-gb 3 --reps 3     # the reported figure

1. A "worker" process builds the state (fp32 tensors, fixed seed), saves it with
   ``CheckpointManager(root, ram_tier=True)``, waits until the background copy to disk is
   done, and dies without closing the manager (``os._exit``), as a crashed worker would: the
   RAM tier in /dev/shm stays.
2. For each repetition, a fresh "restarted worker" process is started per source and measures,
   from the moment it was launched: imports, allocating the state, ``restore``. Sources:
   ``ram`` (the manager with ``ram_tier=True``), ``disk-cold`` (no RAM tier; the checkpoint's
   pages are dropped from the page cache first with ``posix_fadvise(DONTNEED)``) and
   ``disk-hot`` (no RAM tier, every file read once just before, as ``bench.run``'s hot loads:
   the best case for disk; the cold restore before it read with O_DIRECT and cached nothing).
Every restore is checked against the saved values. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .measure import prewarm

TENSOR_MB = 64


def _shapes(size_gb: float) -> list[tuple[str, int]]:
    """GPT-like mix: a few big matrices plus 1/32 of the bytes in small tensors (numel each)."""
    total = int(size_gb * 1e9) // 4
    big = TENSOR_MB * (1 << 20) // 4
    out = [(f"w{i:04d}", big) for i in range(max(1, total * 31 // 32 // big))]
    small = max(1, (total - sum(n for _, n in out)) // 200)
    out += [(f"s{i:04d}", small) for i in range(200)]
    return out


def _state(size_gb: float, fill: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    st = {}
    for name, n in _shapes(size_gb):
        t = torch.empty(n, dtype=torch.float32)
        st[name] = t.normal_(generator=g) if fill else t
    return st


def worker_save(root: str, size_gb: float) -> None:
    import trainguard as tg

    state = {"model": tg.StateDict(**_state(size_gb, fill=True))}
    sums = {k: float(v[:1000].sum()) for k, v in state["model"].items() if k in ("w0000", "s0199")}
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=True).open()
    t0 = time.perf_counter()
    mgr.save(1, state)
    t_ram = time.perf_counter() - t0
    mgr.ram.wait()
    t_all = time.perf_counter() - t0
    print(json.dumps({"sums": sums, "save_ram_s": t_ram, "save_to_disk_s": t_all}), flush=True)
    os._exit(0)  # a crashed worker: no close(), the RAM tier stays


def worker_restore(root: str, size_gb: float, source: str, launched: float) -> None:
    t_start = time.time()
    import torch  # noqa: F401
    import torch.distributed.tensor  # noqa: F401  (trainguard imports it lazily; count it as import time)

    import trainguard as tg

    t_import = time.time()
    state = {"model": tg.StateDict(**_state(size_gb, fill=False))}
    t_alloc = time.time()
    mgr = tg.CheckpointManager(root, ram_tier=source == "ram", handle_signals=False).open()
    step = mgr.restore(state)
    t_done = time.time()
    sums = {k: float(v[:1000].sum()) for k, v in state["model"].items() if k in ("w0000", "s0199")}
    tier = "ram" if source == "ram" else "disk"
    print(json.dumps({
        "step": step, "tier": tier, "sums": sums, "start_s": t_start - launched, "import_s": t_import - t_start,
        "alloc_s": t_alloc - t_import, "restore_s": t_done - t_alloc, "total_s": t_done - launched,
    }), flush=True)
    if source == "ram":
        mgr.ram.wait()  # restore may re-copy to disk; nothing to do here (already there)
    os._exit(0)


def _evict(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _child(*args: str, timeout: float) -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "bench.ram_tier", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the durable tier goes (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--_save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_restore", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_launched", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._save:
        return worker_save(a._root, a.size_gb)
    if a._restore:
        return worker_restore(a._root, a.size_gb, a._restore, a._launched)

    from trainguard.tiers import ram_dir

    base = Path(tempfile.mkdtemp(prefix="tg-ramtier-", dir=a.dir))
    root = str(base / "run")
    timeout = 120 + 120 * a.size_gb
    results: dict[str, list[dict]] = {"ram": [], "disk-cold": [], "disk-hot": []}
    try:
        saved = _child("--_save", "--_root", root, "--size-gb", str(a.size_gb), timeout=timeout)
        print(f"state {a.size_gb} GB: save to RAM tier {saved['save_ram_s']:.2f} s, "
              f"until also on disk {saved['save_to_disk_s']:.2f} s")
        for _ in range(a.reps):
            for source in results:
                if source == "disk-cold":
                    _evict(base / "run")
                elif source == "disk-hot":  # the cold restore read with O_DIRECT: nothing of it is cached
                    prewarm(base / "run")
                res = _child("--_restore", source, "--_root", root, "--size-gb", str(a.size_gb),
                             "--_launched", repr(time.time()), timeout=timeout)
                if res["step"] != 1 or res["sums"] != saved["sums"]:
                    raise RuntimeError(f"{source}: restored the wrong state: {res}")
                results[source].append(res)
        print(f"\nrestart -> restored state, {a.size_gb} GB, {a.reps} rep(s) (median; first rep in brackets)")
        print(f"{'source':<10} {'total s':>9} {'restore s':>10} {'GB/s':>6}  (process start + imports + alloc)")
        for source, rs in results.items():
            tot = statistics.median(r["total_s"] for r in rs)
            rst = statistics.median(r["restore_s"] for r in rs)
            other = statistics.median(r["start_s"] + r["import_s"] + r["alloc_s"] for r in rs)
            print(f"{source:<10} {tot:>9.2f} {rst:>10.2f} {a.size_gb / rst:>6.2f}  ({other:.2f})"
                  f"  [{rs[0]['total_s']:.2f} / {rs[0]['restore_s']:.2f}]")
        if a.json:
            Path(a.json).write_text(json.dumps({"size_gb": a.size_gb, "save": saved, "results": results}, indent=1))
    finally:
        shutil.rmtree(ram_dir(root), ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(ram_dir(root)))  # the per-user dir, if now empty
        except OSError:
            pass
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
