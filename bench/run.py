"""Run the benchmark: ``python -m bench.run [--quick] [--only STATES] [--methods M,..] [--scale S]``.

Spawns one worker process per state (two, ranks 0 and 1, for ``ddp``), one state after another,
each bounded by ``--timeout`` and killed by its PID's process group when it runs past it.
Writes ``<out-dir>/latest.json``, ``latest.md`` and ``latest.png`` (default bench/results/).
Temporary checkpoints live under ``--tmp`` (default bench/.tmp/run-<pid>) and are removed at
the end. ``BENCH_SCALE`` in the environment sets the default ``--scale``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from . import report, sysinfo
from .config import ALL_STATES, METHOD_NAMES, QUICK_STATES, Config, wanted
from .shapes import shapes_bytes, state_shapes

REPO = Path(__file__).resolve().parent.parent


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=float(os.environ.get("BENCH_SCALE", "1.0")),
                   help="multiply every state's size (e.g. 0.01 while developing)")
    p.add_argument("--reps", type=int, default=None, help="steady-state repetitions (default 3)")
    p.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK_STATES)}, 3 reps")
    p.add_argument("--only", type=_csv, default=None, help=f"states, from {','.join(ALL_STATES)}")
    p.add_argument("--methods", type=_csv, default=(), help=f"names or prefixes: {','.join(METHOD_NAMES)}")
    p.add_argument("--step-seconds", type=float, default=0.5, help="training step time of the stall loop")
    p.add_argument("--cold", default="auto", choices=["auto", "drop_caches", "fadvise", "none"])
    p.add_argument("--n-small", type=int, default=10_000, help="tensor count of small10k")
    p.add_argument("--ddp-base", default="gpt", choices=["100mb", "gpt", "small10k"],
                   help="the state each DDP rank holds")
    p.add_argument("--ratio-base", type=_csv, default=("trainguard", "trainguard_async"),
                   help="SYNC,ASYNC methods whose ratios to the others are reported")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tmp", type=Path, default=REPO / "bench" / ".tmp")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed per state")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def make_config(a: argparse.Namespace, tmp: Path) -> Config:
    states = a.only or (QUICK_STATES if a.quick else ALL_STATES)
    wanted(a.methods)  # fail now, not in a worker, on an unknown name
    cfg = Config(scale=a.scale, reps=a.reps or 3, states=tuple(states), methods=a.methods,
                 step_seconds=a.step_seconds, cold=a.cold, n_small=a.n_small, ddp_base=a.ddp_base,
                 tmp=str(tmp), async_timeout_s=min(900.0, a.timeout / 2))
    return _fit_ddp(cfg) if "ddp" in cfg.states else cfg


def _fit_ddp(cfg: Config) -> Config:
    """Each DDP rank holds the state, one cached staging copy and one transient copy (loads that
    return new tensors): 3x per rank. Fall back to the 100 MB model when that does not fit."""
    nbytes = shapes_bytes(state_shapes(cfg.ddp_base, cfg.scale, cfg.n_small, cfg.seed))
    avail = psutil.virtual_memory().available
    if cfg.ddp_base == "100mb" or 2 * 3 * nbytes < 0.85 * avail:
        return cfg
    note = (f"ddp: each rank would hold a replica of `{cfg.ddp_base}` ({nbytes / 1e9:.2f} GB), needing "
            f"~{6 * nbytes / 2**30:.1f} GiB with staging copies; only {avail / 2**30:.1f} GiB available, "
            "so the 2-rank case used `100mb`")
    return dataclasses.replace(cfg, ddp_base="100mb", notes=cfg.notes + (note,))


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker leads its own session: only its tree
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(timeout=30)


def run_state(state: str, cfg_path: Path, tmp: Path, timeout: float) -> dict:
    """Run one state's worker(s); returns rank 0's JSON, partial with a "failed" note if need be."""
    world = 2 if state == "ddp" else 1
    out = tmp / f"{state}.json"
    store = tmp / f"{state}.store"
    store.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    failed = None
    try:
        for rank in range(world):
            cmd = [sys.executable, "-m", "bench.worker", "--config", str(cfg_path), "--state", state,
                   "--rank", str(rank), "--world", str(world), "--store", str(store), "--out", str(out)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, start_new_session=True))
        while any(p.poll() is None for p in procs):
            if time.monotonic() - t0 > timeout:
                failed = f"timed out after {timeout:.0f} s (workers killed)"
                break
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # a peer of a failed rank is stuck in a collective: give it 5 s, then stop it
                break
            time.sleep(0.2)
    finally:
        _kill(procs)
    raw: dict = json.loads(out.read_text()) if out.exists() else {"state": state}
    for err in sorted(tmp.glob(f"{out.name}.rank*.err")):
        name, _, tb = err.read_text().partition("\n")
        raw.setdefault("errors", {})[name] = f"({err.suffixes[-2][1:]}) {tb}"
    codes = [p.returncode for p in procs]
    if failed is None and (any(codes) or not raw.get("complete")):
        failed = f"worker exit codes {codes}" + (f"; failing: {', '.join(raw['errors'])}" if raw.get("errors") else "")
    if failed:
        raw["failed"] = failed
    return raw


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    tmp = a.tmp / f"run-{os.getpid()}"
    cfg = make_config(a, tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: dict[str, dict] = {}
    try:
        machine = sysinfo.describe(tmp)
        cfg_path = tmp / "config.json"
        cfg_path.write_text(cfg.to_json())
        for state in cfg.states:
            print(f"[bench] state {state} ...", file=sys.stderr, flush=True)
            results[state] = run_state(state, cfg_path, tmp, a.timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = report.build(cfg, machine, results, ratio_base=a.ratio_base, argv=sys.argv[1:] if argv is None else argv,
                       wall_s=time.time() - t0)
    (a.out_dir / "latest.json").write_text(json.dumps(doc, indent=1))
    (a.out_dir / "latest.md").write_text(report.markdown(doc))
    if not a.no_plot:
        from . import plot

        plot.save_png(doc, a.out_dir / "latest.png")
    print(f"[bench] wrote {a.out_dir}/latest.{{json,md{'' if a.no_plot else ',png'}}}", file=sys.stderr)
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
