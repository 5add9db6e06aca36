"""One benchmark process (one rank): builds a state once, measures every selected method on it.

Started by ``bench.run`` as ``python -m bench.worker --config C --state S --rank R --world W
--store F --out O``; all ranks of a state run the same rounds in the same order. Round 0 is the
"first" repetition; rounds 1..reps are the steady state. Synchronous methods run round-robin
(round r of each, back to back, on the same tensors), so a round's figures compare pair by pair;
async methods run one at a time (see :func:`run_rounds`).
Rank 0 writes the JSON; per-rank figures are combined as: time = max, peak memory = max.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from .base import AsyncMethod, Ctx, LoadVariant, SyncMethod
from .config import Config
from .loop import Trainer, run_async
from .measure import CacheDropper, PeakMeter, dir_bytes, fsync_tree, prewarm, release_free_memory
from .methods import Selection, describe, select
from .methods_raw import memcpy, memcpy_dest
from .states import State, build_state, check_marks, mark, state_bytes


class Recorder:
    """Figures of this state; rank 0 rewrites ``out`` (atomically) after every method's round, so
    a run that is killed or fails on another rank still leaves what it measured."""

    def __init__(self, ctx: Ctx, out: Path, header: dict) -> None:
        self.ctx = ctx
        self.out = out
        self.header = header
        self.records: list[dict] = []
        self.errors: dict[str, str] = {}
        self.warnings: dict[str, list[str]] = {}
        self.ckpt_bytes: dict[str, int] = {}

    def dump(self, *, complete: bool) -> None:
        if self.ctx.rank != 0:
            return
        doc = {**self.header, "complete": complete, "records": self.records, "errors": self.errors,
               "warnings": {k: v for k, v in self.warnings.items() if v}, "ckpt_bytes": self.ckpt_bytes}
        tmp = self.out.with_name(self.out.name + ".part")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.out)

    def add(self, method: str, op: str, variant: str, rnd: int, **fig: object) -> None:
        """Combine one measurement across ranks (collective) and keep it on rank 0."""
        per_rank = self.ctx.gather(fig)
        rec: dict = {"method": method, "op": op, "variant": variant, "round": rnd}
        for k, v in fig.items():
            vals = [p[k] for p in per_rank]
            if isinstance(v, bool):
                rec[k] = all(vals)
            elif isinstance(v, (int, float)):
                rec[k] = max(vals)
            else:
                rec[k] = vals[0]
        if self.ctx.world > 1 and "peak_extra" in fig:
            rec["peak_extra_per_rank"] = [p["peak_extra"] for p in per_rank]
        self.records.append(rec)


def _fresh_dir(ctx: Ctx, d: Path) -> None:
    release_free_memory(full=True)  # once per method and round: what the last one left behind
    if ctx.rank == 0:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    ctx.barrier()


def _load_once(ctx: Ctx, rec: Recorder, m: SyncMethod, v: LoadVariant, d: Path, state: State,
               rnd: int, tag: float, op: str) -> None:
    if v.in_place:
        mark(state, -1.0)  # the state must differ before the load and match after it
    ctx.barrier()
    with PeakMeter() as pm:
        t0 = time.perf_counter()
        out = v.fn(ctx, d, state)
        ctx.barrier()
        sec = time.perf_counter() - t0
    problem = check_marks(out if out is not None else state, list(state), tag)
    del out
    if problem:
        raise AssertionError(f"{m.name} {v.name}: loaded data is wrong: {problem}")
    rec.add(m.name, op, v.name, rnd, seconds=sec, peak_extra=pm.extra)


def run_sync(ctx: Ctx, rec: Recorder, m: SyncMethod, root: Path, state: State, rnd: int,
             dropper: CacheDropper) -> None:
    d = root / m.name
    tag = float(1000 + rnd)
    _fresh_dir(ctx, d)
    mark(state, tag)
    ctx.barrier()
    with PeakMeter() as pm:
        t0 = time.perf_counter()
        m.save(ctx, d, state)
        ctx.barrier()
        if ctx.rank == 0:
            fsync_tree(d)  # durability is part of the save time, for every method alike
        ctx.barrier()
        sec = time.perf_counter() - t0
    rec.add(m.name, "save", "", rnd, seconds=sec, peak_extra=pm.extra)
    if ctx.rank == 0:
        rec.ckpt_bytes[m.name] = dir_bytes(d)
    for v in m.loads:
        if ctx.rank == 0:
            prewarm(d)
        _load_once(ctx, rec, m, v, d, state, rnd, tag, "load_hot")
        if dropper.mode != "none":
            if ctx.rank == 0:
                dropper.drop(d)
            _load_once(ctx, rec, m, v, d, state, rnd, tag, "load_cold")
    ctx.barrier()
    if ctx.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def run_memcpy(ctx: Ctx, rec: Recorder, state: State, rnd: int) -> None:
    dest = memcpy_dest(state)
    ctx.barrier()
    with PeakMeter() as pm:
        t0 = time.perf_counter()
        memcpy(state, dest)
        sec = time.perf_counter() - t0
    del dest
    rec.add("memcpy", "copy", "", rnd, seconds=sec, peak_extra=pm.extra)


def run_one_async(ctx: Ctx, rec: Recorder, a: AsyncMethod, root: Path, state: State, rnd: int,
                  trainer: Trainer, cfg: Config) -> None:
    d = root / a.name
    _fresh_dir(ctx, d)
    fig = run_async(ctx, a, state, d, trainer, cfg.async_timeout_s)
    problem = fig.pop("problem")
    if problem:
        rec.warnings.setdefault(a.name, []).append(f"round {rnd}: snapshot not consistent: {problem}")
    rec.add(a.name, "async", "", rnd, **fig)
    ctx.barrier()
    if ctx.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def _guarded(ctx: Ctx, rec: Recorder, name: str, fn) -> None:
    """Run one method's round, collecting its warnings.

    One rank: a failure is recorded and the method dropped from later rounds. Several ranks: the
    failing rank cannot know where its peers are among their collectives, so it leaves its
    traceback in ``<out>.rank<r>.err`` and exits; ``bench.run`` stops the peers and keeps what
    rank 0 had written.
    """
    err = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception:
            err = traceback.format_exc(limit=8)
    seen = rec.warnings.setdefault(name, [])
    for w in caught:
        msg = f"{w.category.__name__}: {str(w.message).splitlines()[0][:240]}"
        if msg not in seen:
            seen.append(msg)
    if err is None:
        rec.dump(complete=False)
        return
    print(f"[bench] rank {ctx.rank}: {name} failed:\n{err}", file=sys.stderr, flush=True)
    rec.errors[name] = err
    rec.dump(complete=False)
    if ctx.world > 1:
        rec.out.with_name(f"{rec.out.name}.rank{ctx.rank}.err").write_text(f"{name}\n{err}")
        os._exit(2)


def run_rounds(ctx: Ctx, cfg: Config, sel: Selection, state: State, root: Path, rec: Recorder,
               dropper: CacheDropper, trainer: Trainer | None) -> None:
    """Synchronous methods round-robin (round r of every method back to back, the order rotated
    by one method each round, so that no method always runs after the same one: whatever a
    method leaves behind, the memory it freed, its deleted files, falls on each of the others
    in turn); then each async method for all its rounds, closed before the next one, so
    that at most one method's cached staging copy of the state is alive at a time (two would
    not fit in RAM in the 2-rank case)."""
    for rnd in range(cfg.reps + 1):
        k = rnd % max(1, len(sel.sync))
        for m in [*sel.sync[k:], *sel.sync[:k]]:
            if m.name not in rec.errors:
                _guarded(ctx, rec, m.name, partial(run_sync, ctx, rec, m, root, state, rnd, dropper))
        if sel.memcpy and "memcpy" not in rec.errors:
            _guarded(ctx, rec, "memcpy", partial(run_memcpy, ctx, rec, state, rnd))
        _progress(ctx, f"sync round {rnd}", rec)
    for a in sel.async_:
        for rnd in range(cfg.reps + 1):
            if a.name not in rec.errors and trainer is not None:
                _guarded(ctx, rec, a.name, partial(run_one_async, ctx, rec, a, root, state, rnd, trainer, cfg))
        if a.close is not None:
            a.close(ctx)
        release_free_memory(full=True)
        _progress(ctx, a.name, rec)


def _progress(ctx: Ctx, what: str, rec: Recorder) -> None:
    if ctx.rank == 0:
        print(f"[bench] {what} done ({len(rec.records)} figures)", file=sys.stderr, flush=True)


def init_ctx(rank: int, world: int, store_path: str) -> Ctx:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    return Ctx(rank=rank, world=world, pg=None, ckpt_pg=dist.new_group(backend="gloo"))


def _exit_with_parent() -> None:
    """Exit if ``bench.run`` dies: workers lead their own sessions and would otherwise linger."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker")
    for a in ("--config", "--state", "--store", "--out"):
        p.add_argument(a, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    args = p.parse_args(argv)
    cfg = Config.from_file(Path(args.config))
    _exit_with_parent()
    t_start = time.perf_counter()
    peak_mode = PeakMeter.detect()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    ctx = init_ctx(args.rank, args.world, args.store)
    base = cfg.ddp_base if args.state == "ddp" else args.state
    state = build_state(base, cfg.scale, cfg.n_small, cfg.seed)
    sel = select(cfg.methods)
    dropper = CacheDropper(cfg.cold)
    trainer = Trainer(cfg.step_seconds) if sel.async_ else None
    rec = Recorder(ctx, Path(args.out), {
        "state": args.state, "base_state": base, "world": ctx.world, "bytes": state_bytes(state),
        "tensors": len(state), "threads_per_rank": torch.get_num_threads(), "peak_mode": peak_mode,
        "cold_mode": dropper.mode, "cold_how": dropper.describe(), "skipped": sel.skipped,
        "step_seconds": trainer.calibrated_step_s if trainer else None, "methods": describe(),
    })
    gc.freeze()  # modules and the state: never garbage, and a full gc.collect() no longer walks them
    try:
        run_rounds(ctx, cfg, sel, state, Path(cfg.tmp) / args.state, rec, dropper, trainer)
    finally:
        for m in [*sel.sync, *sel.async_]:
            if m.close is not None:
                m.close(ctx)
    ctx.barrier()
    dist.destroy_process_group()
    rec.header["wall_s"] = time.perf_counter() - t_start
    rec.dump(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
