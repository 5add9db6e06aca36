"""Training stall of async checkpointing, in a real training loop (model + Adam), one process.

``python -m bench.stall [--quick] [--gb 1,3] [--step-s 0.5] [--steps N] [--every K]``

For each state size, in the same process on the same model and optimizer:

- ``none``: N training steps without checkpoints (the baseline for the overhead ratio);
- ``tg_sync``: ``tg.save(path, state)`` every K steps;
- ``tg_async``: ``tg.save(path, state, async_=True)`` every K steps (stall = the call, which
  includes waiting for the previous save, + the time ``optimizer.step()`` waited in
  trainguard's pre-step hook);
- ``dcp_async``: ``dcp.async_save`` with its default stager (stall = the call + waiting for the
  previous save before the next one);
- ``dcp_async_bg``: ``dcp.async_save`` with one reused ``DefaultStager`` staging in the
  background (its best options: pinned memory and non-blocking copies with ``--device cuda``;
  on the CPU, pinned/shared memory are unavailable); stall also includes waiting for ``staging_completion`` before ``optimizer.step()``.

Each method's first save (buffer allocation, pinned memory) is made and timed apart before its
timed run, after a full garbage collection (what the methods before left); the run ends with
its last step (the last save's drain is reported apart).

Reported per method: stall per save (median, max; ``calls_s``: each one's part in the call,
``wait_previous_s``: of that, its wait for the previous save), end-to-end time and overhead vs
``none`` (round by round), the cost per save (extra seconds of the run per save), the same two
from the run's own steps (stalls plus what the steps that overlapped a save took beyond the
run's quiet median: ``cost_from_steps_s``, ``overhead_from_steps``; free of the drift between
two runs), the step-time slowdown while a save is in flight (CPU stolen by the background
writer), and for ``tg_async`` the RSS after each save (growth over the run) and the staging
pool's size.

``--writers``: the thread-vs-process decision: one training loop while a *thread* writes and
checksums a buffer, then while a separate *process* does the same; step slowdown and MB/s each.

``--device cuda``: the model trains on the GPU (the case async saving is for: the writer's CPU
time does not compete with the training step); trainguard stages into pinned memory.

``--quick``: ~240 MB of state (model + Adam), 16 steps of ~0.3 s, a save every 4: for
development on a shared 2-core machine. Writes ``bench/results/stall.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import xxhash
from torch import nn

import trainguard as tg
from trainguard.stage import default_pool

REPO = Path(__file__).resolve().parent.parent
WIDTH = 1024


def build(total_bytes: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose fp32 parameters + Adam moments take about ``total_bytes``."""
    torch.manual_seed(0)
    layer = (WIDTH * WIDTH + WIDTH) * 4 * 3
    n = max(2, round(total_bytes / layer))
    model = nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    return model, opt


class Loop:
    """One training step = forward + backward + Adam step on a batch calibrated to ``step_s``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, step_s: float) -> None:
        self.model, self.opt, self.batch = model, opt, 16
        self.device = next(model.parameters()).device
        for _ in range(3):
            self.step()  # creates Adam state, warms up the allocator and thread pool
        for _ in range(6):  # calibrate until close: the first estimates are from tiny batches
            t = statistics.median(self._timed() for _ in range(3))
            self.batch = max(1, round(self.batch * min(step_s / t, 50.0)))
            if abs(t / step_s - 1) < 0.15:
                break
        self.base = statistics.median(self._timed() for _ in range(3))

    def _timed(self) -> float:
        t0 = time.perf_counter()
        self.step()
        self.sync()
        return time.perf_counter() - t0

    def sync(self) -> None:
        """Wait for the GPU's queued work, so step times are real (no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_backward(self) -> None:
        x = torch.randn(self.batch, WIDTH, device=self.device)
        self.opt.zero_grad(set_to_none=False)
        self.model(x).square().mean().backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()


def _dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class Method:
    """Start a save, and say how long training must wait before the optimizer may step again."""

    name = ""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.prev: Any = None
        self.prev_waits: list[float] = []  # part of each call spent waiting for the previous save (async methods)

    def save(self, path: Path) -> float:  # returns seconds blocked in the call
        raise NotImplementedError

    def before_step(self) -> float:  # seconds waited before optimizer.step()
        return 0.0

    def in_flight(self) -> bool:
        return False

    def finish(self) -> None:
        pass


class TgSync(Method):
    name = "tg_sync"

    def save(self, path: Path) -> float:
        t0 = time.perf_counter()
        tg.save(path, {"model": self.model, "optim": self.opt})
        return time.perf_counter() - t0


class TgAsync(Method):
    name = "tg_async"

    def save(self, path: Path) -> float:
        t0 = time.perf_counter()
        if self.prev is not None:
            self.prev.result()  # trainguard would wait inside the call anyway; timed apart here
        t1 = time.perf_counter()
        self.prev = tg.save(path, {"model": self.model, "optim": self.opt}, async_=True)
        self.prev_waits.append(t1 - t0)
        return time.perf_counter() - t0

    def before_step(self) -> float:
        return 0.0  # trainguard's own hook blocks inside optimizer.step(): counted via hook_wait_s

    def hook_wait(self) -> float:
        return self.prev.hook_wait_s if self.prev is not None else 0.0

    def in_flight(self) -> bool:
        return self.prev is not None and not self.prev.done()

    def finish(self) -> None:
        if self.prev is not None:
            self.prev.result()


class DcpAsync(Method):
    name = "dcp_async"
    background = False

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(model, opt)
        self.stager = None
        if self.background:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = next(model.parameters()).is_cuda  # pinned memory and non-blocking copies need CUDA
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=gpu,
            ))

    def save(self, path: Path) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.finish()  # one save in flight, like trainguard: the wait counts as stall
        self.prev_waits.append(time.perf_counter() - t0)
        sd = _dcp_state(self.model, self.opt)
        if self.stager is None:
            self.prev = dcp.async_save(sd, checkpoint_id=str(path))
        else:
            writer = dcp.FileSystemWriter(str(path), thread_count=2)
            self.prev = dcp.async_save(sd, storage_writer=writer, async_stager=self.stager)
        return time.perf_counter() - t0

    def before_step(self) -> float:
        staging = getattr(self.prev, "staging_completion", None)
        if staging is None or staging.done():
            return 0.0
        t0 = time.perf_counter()
        staging.result()
        return time.perf_counter() - t0

    def _future(self) -> Any:
        return getattr(self.prev, "upload_completion", self.prev)

    def in_flight(self) -> bool:
        return self.prev is not None and not self._future().done()

    def finish(self) -> None:
        if self.prev is not None:
            self.before_step()
            self._future().result()
            self.prev = None


class DcpAsyncBg(DcpAsync):
    name = "dcp_async_bg"
    background = True


def first_save(m: Method, loop: Loop, every: int, tmp: Path) -> dict[str, Any]:
    """The method's first save (allocations of staging buffers, pinned memory, imports), with
    ``every`` steps overlapping it, then drained: reported apart from the steady state."""
    path = tmp / f"{m.name}-first"
    call = m.save(path)
    t0 = time.perf_counter()
    waited = 0.0
    for _ in range(every):
        loop.forward_backward()
        waited += m.before_step()
        hook0 = m.hook_wait() if isinstance(m, TgAsync) else 0.0
        loop.opt.step()
        loop.sync()
        if isinstance(m, TgAsync):
            waited += m.hook_wait() - hook0
    steps = time.perf_counter() - t0
    m.finish()
    shutil.rmtree(path, ignore_errors=True)
    return {"stall_s": call + waited, "steps_extra_s": steps - waited - every * loop.base}


def run_method(m: Method | None, loop: Loop, steps: int, every: int, tmp: Path) -> dict[str, Any]:
    """``steps`` training steps, a save after every ``every``-th; per-save stall and step times.
    The first save of each method is made and timed apart before (``first_save``)."""
    # Garbage the methods run before left is freed now, not by a collection that happens to fall
    # inside this method's save or step.
    gc.collect()
    first = first_save(m, loop, every, tmp) if m is not None else None
    m = type(m)(m.model, m.opt) if m is not None else None  # no state carried over but the library's own
    stalls: list[float] = []
    calls: list[float] = []  # each stall's part in the save call; the rest waited before step()
    step_times: list[tuple[float, bool]] = []
    rss: list[int] = []
    proc = psutil.Process()
    saves: list[Path] = []
    book = 0.0
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        flying = m is not None and m.in_flight()
        loop.forward_backward()
        waited = m.before_step() if m is not None else 0.0
        hook0 = m.hook_wait() if isinstance(m, TgAsync) else 0.0
        loop.opt.step()
        loop.sync()
        if isinstance(m, TgAsync):
            waited += m.hook_wait() - hook0
        if stalls and waited:
            stalls[-1] += waited
        step_times.append((time.perf_counter() - t0 - waited, flying))
        if m is not None and i % every == 0 and i < steps:  # no save after the last step: see below
            path = tmp / f"{m.name}-{i:06d}"
            stalls.append(m.save(path))
            calls.append(stalls[-1])
            saves.append(path)
            t_book = time.perf_counter()
            if len(saves) > 2:  # keep the disk bounded; the oldest is committed by now
                shutil.rmtree(saves.pop(0), ignore_errors=True)
            rss.append(proc.memory_info().rss)
            book += time.perf_counter() - t_book  # the bench's own housekeeping: not counted
    # The run's time ends with its last step: waiting for the last save to drain is not time the
    # training loop lost (a real run keeps training meanwhile), so it is reported apart.
    total = time.perf_counter() - t_start - book
    t_drain = time.perf_counter()
    if m is not None:
        m.finish()
    drain = time.perf_counter() - t_drain
    for p in saves:
        shutil.rmtree(p, ignore_errors=True)
    quiet_med = statistics.median([t for t, f in step_times if not f] or [loop.base])
    busy = [t for t, f in step_times if f]
    # The training time a save cost, from this run's own steps: its stall plus what the steps
    # that overlapped it took beyond the run's quiet median (not comparing totals of two runs,
    # which drift apart on a shared machine by as much as the effect itself).
    lost = sum(stalls) + sum(t - quiet_med for t in busy)
    out: dict[str, Any] = {
        "first_save": first,
        "saves": len(stalls),
        "total_s": total,
        "drain_s": drain,
        "housekeeping_s": book,
        "step_s": [round(t, 4) for t, _ in step_times],
        "stalls_s": stalls,
        "calls_s": calls,  # an outlier stall: in the call, or waiting before step()?
        "stall_median_s": statistics.median(stalls) if stalls else 0.0,
        "stall_max_s": max(stalls) if stalls else 0.0,
        "step_quiet_median_s": quiet_med,
        "step_in_flight_median_s": statistics.median(busy) if busy else None,
        "in_flight": [int(f) for _, f in step_times],
        "cost_from_steps_s": lost / len(stalls) if stalls else 0.0,
        "overhead_from_steps": lost / (len(step_times) * quiet_med),
    }
    if rss:
        out["rss_after_saves_mb"] = [round(r / 2**20) for r in rss]
    if m is not None and m.prev_waits:
        out["wait_previous_s"] = m.prev_waits
    return out


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one method: stalls pooled (median, max), totals and step times by median."""
    stalls = [x for r in runs for x in r["stalls_s"]]
    busy = [r["step_in_flight_median_s"] for r in runs if r["step_in_flight_median_s"]]
    out = {
        "rounds": runs,
        "total_s": statistics.median(r["total_s"] for r in runs),
        "stalls_s": stalls,
        "calls_s": [x for r in runs for x in r["calls_s"]],
        "stall_median_s": statistics.median(stalls) if stalls else 0.0,
        "stall_max_s": max(stalls) if stalls else 0.0,
        "step_quiet_median_s": statistics.median(r["step_quiet_median_s"] for r in runs),
        "step_in_flight_median_s": statistics.median(busy) if busy else None,
        "cost_from_steps_s": statistics.median(r["cost_from_steps_s"] for r in runs),
        "overhead_from_steps": statistics.median(r["overhead_from_steps"] for r in runs),
    }
    if "rss_after_saves_mb" in runs[0]:
        out["rss_after_saves_mb"] = [x for r in runs for x in r["rss_after_saves_mb"]]
    if "wait_previous_s" in runs[0]:
        out["wait_previous_s"] = [x for r in runs for x in r.get("wait_previous_s", [])]
    return out


# ------------------------------------------------------------------ thread vs process writer


def _write_loop(path: str, nbytes: int, ready: Any, stop: Any, out: Any) -> None:
    """Write + checksum + fsync ``nbytes`` again and again until ``stop``; bytes written to ``out``."""
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    ready.set()
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while not stop.is_set():
            for off in range(0, nbytes, 16 << 20):
                v = mv[off : off + (16 << 20)]
                os.pwrite(fd, v, off)
                xxhash.xxh3_64_hexdigest(v)
                done += len(v)
                if stop.is_set():
                    break
            os.fsync(fd)
    finally:
        os.close(fd)
        out.value = done


def writers(loop: Loop, nbytes: int, tmp: Path, steps: int = 4) -> dict[str, Any]:
    """Median step time while a thread, then a process, writes continuously (vs quiet steps just
    before), and the writer's MB/s: the thread-vs-process decision for the background writer."""
    out: dict[str, Any] = {"bytes": nbytes}
    for kind in ("thread", "process"):
        quiet = statistics.median(loop._timed() for _ in range(steps))
        path = str(tmp / f"blob-{kind}")
        if kind == "thread":
            ready, stop, res = threading.Event(), threading.Event(), mp.Value("q", 0, lock=False)
            w: Any = threading.Thread(target=_write_loop, args=(path, nbytes, ready, stop, res))
        else:
            ctx = mp.get_context("spawn")
            ready, stop, res = ctx.Event(), ctx.Event(), ctx.Value("q", 0, lock=False)
            w = ctx.Process(target=_write_loop, args=(path, nbytes, ready, stop, res))
        w.start()
        ready.wait(120)
        t0 = time.perf_counter()
        busy = [loop._timed() for _ in range(steps)]
        stop.set()
        w.join(120)
        elapsed = time.perf_counter() - t0
        if kind == "process" and w.is_alive():
            w.kill()
        out[kind] = {
            "quiet_step_s": quiet,
            "busy_step_s": statistics.median(busy),
            "slowdown": statistics.median(busy) / quiet - 1,
            "write_MBps": res.value / 2**20 / elapsed,
        }
        os.unlink(path)
    return out


# ------------------------------------------------------------------ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~240 MB state, short run (development)")
    p.add_argument("--gb", default="1,3", help="state sizes in GB (model + Adam), comma separated")
    p.add_argument("--step-s", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--methods", default="tg_async,dcp_async,dcp_async_bg,tg_sync")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every method")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, or cuda (pinned staging)")
    p.add_argument("--writers", action="store_true", help="also measure thread vs process writer")
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "stall.json")
    a = p.parse_args(argv)
    if a.quick:
        a.gb, a.step_s, a.steps, a.every = "0.24", 0.3, 16, 4
    return a


METHODS = {c.name: c for c in (TgSync, TgAsync, DcpAsync, DcpAsyncBg)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    a.tmp.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="stall-", dir=a.tmp))
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "sizes": {}}
    try:
        for gb in [float(x) for x in a.gb.split(",")]:
            model, opt = build(int(gb * 1e9), a.device)
            loop = Loop(model, opt, a.step_s)
            nbytes = sum(p.nbytes for p in model.parameters()) * 3
            r: dict[str, Any] = {"state_bytes": nbytes, "batch": loop.batch, "base_step_s": loop.base}
            names = ["none", *a.methods.split(",")]
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for _ in range(a.rounds):  # interleaved rounds: load changes on a shared machine hit all alike
                for name in names:
                    m = None if name == "none" else METHODS[name](model, opt)
                    runs[name].append(run_method(m, loop, a.steps, a.every, tmp))
            for name in names:
                r[name] = _combine(runs[name])
                # Pair round i of the method with round i of no checkpoints (load drifts on a shared machine).
                pairs = list(zip(runs[name], runs["none"]))
                r[name]["overhead"] = statistics.median(a["total_s"] / b["total_s"] - 1 for a, b in pairs)
                if name != "none":
                    r[name]["cost_per_save_s"] = statistics.median((a["total_s"] - b["total_s"]) / max(a["saves"], 1) for a, b in pairs)
                    r[name]["first_save"] = runs[name][0]["first_save"]
            pool = default_pool()
            r["tg_pool"] = {"capacity_mb": pool.capacity / 2**20, "allocations": pool.allocations}
            if "tg_async" in r and "dcp_async" in r and r["dcp_async"]["stall_median_s"]:
                r["tg_vs_dcp_stall"] = r["tg_async"]["stall_median_s"] / r["dcp_async"]["stall_median_s"]
            if a.writers:
                r["writers"] = writers(loop, min(nbytes, 1 << 30), tmp)
            results["sizes"][f"{gb}GB"] = r
            _print(gb, r)
            del model, opt, loop
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")
    return results


def _print(gb: float, r: dict[str, Any]) -> None:
    print(f"\n== {r['state_bytes'] / 1e9:.2f} GB state, step {r['base_step_s']:.3f} s (batch {r['batch']})")
    print(f"{'method':<14}{'stall med':>10}{'stall max':>10}{'total s':>9}{'overhead':>9}{'cost/save s':>12}"
          f"{'step busy/quiet':>17}{'from steps: cost/save, overhead':>33}{'first save: stall, steps +s':>30}")
    for k, v in r.items():
        if isinstance(v, dict) and "total_s" in v:
            busy = v["step_in_flight_median_s"]
            ratio = f"{busy / v['step_quiet_median_s']:.2f}" if busy else "-"
            first = v.get("first_save")
            first_s = f"{first['stall_s']:.3f}, {first['steps_extra_s']:+.3f}" if first else "-"
            cost = v.get("cost_per_save_s")
            print(f"{k:<14}{v['stall_median_s']:>10.4f}{v['stall_max_s']:>10.4f}{v['total_s']:>9.2f}"
                  f"{v.get('overhead', 0.0):>9.1%}{'-' if cost is None else f'{cost:.3f}':>12}{ratio:>17}"
                  f"{v['cost_from_steps_s']:>24.3f} s{v['overhead_from_steps']:>7.1%}{first_s:>30}")
    if "tg_vs_dcp_stall" in r:
        print(f"tg_async stall / dcp_async stall = {r['tg_vs_dcp_stall']:.1%}")
    if "rss_after_saves_mb" in r.get("tg_async", {}):
        t = r["tg_async"]
        print(f"tg_async RSS after each save (MB): {t['rss_after_saves_mb']}; pool {r['tg_pool']}")
    for k, v in r.items():
        if isinstance(v, dict) and v.get("wait_previous_s"):
            print(f"{k}: part of each stall spent waiting for the previous save: {[round(x, 3) for x in v['wait_previous_s']]}")
    if "writers" in r:
        print(f"writers: {json.dumps(r['writers'])}")


if __name__ == "__main__":
    main()
