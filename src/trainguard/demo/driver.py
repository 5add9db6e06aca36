"""``trainguard demo``: the same training twice under ``trainguard run`` (2 workers), once with a
kill injected, once without; prints the table and whether the final weights are identical.

Runs in a temporary directory that is removed at the end (``keep=True`` keeps it); the
timeline PNG of the run with the fault is written to ``plot``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import layout
from ..api import load
from ..elastic.reap import running
from ..elastic.watchdog import _proc_stat, agent_alive
from ..report import load as load_events
from ..report import plot_timeline, summarize
from .model import GPTConfig, TinyGPT

TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def launch(run_dir: str, *, steps: int, save_every: int, size: str, fault: str | None,
           timeout: float, log_path: str, spawn: bool = False, start_method: str = "fork") -> int:
    """One job: ``trainguard run`` with 2 workers on this machine. Returns its exit code.
    ``start_method``: fork or forkserver (with ``--run-path``); ``spawn=True``: new interpreters
    running the script (torchrun's default for a script). The agent's log directory (``--log-dir``:
    its workers' error files) is ``log_path`` without its extension plus ``-agent``, beside the log, in
    the demo's directory and removed with it: without one, torch's agent made a ``torchelastic_*``
    directory in the system's temp directory, which it never removes (two left by every demo, a
    SIGKILLed agent's included)."""
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           "--max-restarts", "3", "--run-dir", run_dir, "--log-dir", os.path.splitext(log_path)[0] + "-agent"]
    cmd += ["--start-method", "spawn"] if spawn else ["--start-method", start_method, "--run-path"]
    if fault:
        cmd += ["--fault", fault]
    cmd += [TRAIN_PY, "--steps", str(steps), "--save-every", str(save_every), "--size", size]
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            return _wait(agent, timeout)
        except subprocess.TimeoutExpired:
            stop(agent)
            return 124
        except BaseException:  # Ctrl-C, or the command's SIGTERM (Terminated): the agent's workers go too
            stop(agent)
            raise


def _wait(agent: subprocess.Popen[bytes], timeout: float) -> int:
    """``agent.wait(timeout)``, noting the processes below the agent every second. An agent that died by
    a signal (a ``kill -9``, the OOM killer) leaves its workers, which exit at their orphan check, but
    write their "orphaned" event first: into the run directory that the demo had removed by then (it
    was there again, ``kill/events.jsonl``, in 2 of 3 tries). Those still running (the same start time:
    not a reused pid) are SIGKILLed, and gone (at most 30 s) when this returns."""
    below: dict[int, int] = {}  # pid -> start time
    end = time.monotonic() + timeout
    while True:
        try:
            rc = agent.wait(timeout=max(0.0, min(1.0, end - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= end:
                raise
            below.update((p, st[1]) for p in descendants(agent.pid) if (st := _proc_stat(p)) is not None)
    if rc < 0:
        left = [p for p, start in below.items() if agent_alive(p, start)]
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        until = time.monotonic() + 30.0
        while (left := [p for p in left if agent_alive(p, below[p])]) and time.monotonic() < until:  # bounded
            time.sleep(0.02)
    return rc


def stop(agent: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """End ``trainguard run`` as a scheduler does: SIGTERM, on which the agent stops its workers,
    then SIGKILL after ``grace_s``, to the agent and every process below it (its workers, their
    DataLoader processes), all gone when this returns. subprocess.run SIGKILLed it at once (its timeout, Ctrl-C), and
    a SIGTERM to the demo ended the demo alone: the agent and its workers trained on, orphaned,
    in the run directory the demo had left behind."""
    agent.terminate()
    try:
        agent.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        # the agent did not stop its workers (stopped, hung): they and their DataLoader processes are
        # killed with it, and gone before the caller removes the run directory. Killed alone, the
        # agent left its workers (each leads a session of its own) saving into the directory for a
        # moment after the demo had removed it and said "removed" (a tmp step dir with a data file).
        tree = descendants(agent.pid)
        agent.kill()
        for pid in tree:  # a worker leads its own group: killpg also takes a loader forked since the scan
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        agent.wait()
        end = time.monotonic() + 30.0
        while (tree := [pid for pid in tree if running(pid)]) and time.monotonic() < end:  # bounded: 30 s
            time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), from ``/proc/*/stat``; [] without ``/proc``."""
    parent: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in found]
        found += kids
        frontier = kids
    return found


def final_weights(run_dir: str, step: int, size: str) -> dict[str, torch.Tensor]:
    model = TinyGPT(GPTConfig.named(size))
    load(os.path.join(run_dir, layout.step_dir(step)), {"model": model}, only=["model"])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _row(name: str, s: dict[str, Any]) -> list[str]:
    rec = s["recoveries"][0] if s["recoveries"] else {}

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    split = (f"{f(rec.get('recover_s'))} ({f(rec.get('detect_s'))}/{f(rec.get('restart_s'))}/"
             f"{f(rec.get('restore_s'))}/{f(rec.get('first_step_s'))})" if rec else "-")
    return [name, str(s["final_step"]), str(s["failures"]), str(s["lost_steps"]), split,
            f(s["save_stall_mean_s"], "{:.4f}"), f(None if s["goodput"] is None else 100 * s["goodput"], "{:.1f}%")]


def table(rows: list[list[str]]) -> str:
    head = ["run", "final step", "failures", "lost steps", "recover s (detect/restart/restore/1st step)",
            "save stall s", "goodput"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def run_demo(*, steps: int = 1000, fault_step: int = 743, save_every: int = 100, size: str = "demo",
             plot: str | None = "trainguard-demo-timeline.png", keep: bool = False, spawn: bool = False,
             start_method: str = "fork", timeout: float = 1200,
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Both runs, the table, the bit-identity check. Returns ``{"identical", "faulty", "clean"}``."""
    if not 0 < fault_step < steps:
        raise ValueError(f"fault step {fault_step} must lie between 0 and steps={steps}")
    work = tempfile.mkdtemp(prefix="trainguard-demo-")
    out: dict[str, Any] = {"workdir": work}
    try:
        for name, fault in (("kill", f"step={fault_step},rank=1,kind=kill"), ("clean", None)):
            rd = os.path.join(work, name)
            echo(f"[{name}] trainguard run: 2 workers, {steps} steps, async checkpoint every {save_every}"
                 + (f", kill rank 1 at step {fault_step}" if fault else ""))
            rc = launch(rd, steps=steps, save_every=save_every, size=size, fault=fault, timeout=timeout,
                        log_path=os.path.join(work, f"{name}.log"), spawn=spawn,
                        start_method=start_method)
            if rc != 0:
                with open(os.path.join(work, f"{name}.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"the {name} run failed (exit code {rc}); its log ends with:\n{tail}")
            out[name] = summarize(load_events(rd))
        a = final_weights(os.path.join(work, "kill"), steps, size)
        b = final_weights(os.path.join(work, "clean"), steps, size)
        out["identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        echo("")
        echo(table([_row("with kill", out["kill"]), _row("no fault", out["clean"])]))
        echo("")
        echo(f"final weights bit-identical: {'YES' if out['identical'] else 'NO'} ({len(a)} tensors compared)")
        if plot:
            plot_timeline(load_events(os.path.join(work, "kill")), plot, title="trainguard demo: kill at step "
                          f"{fault_step}, resume at {fault_step // save_every * save_every}")
            echo(f"timeline: {plot}")
    finally:
        if keep:
            echo(f"run directories kept in {work}")
        else:
            _remove_unsignalled(work)
    return out


def _remove_unsignalled(work: str) -> None:
    """``run_demo``'s removal of its directory with SIGINT and SIGTERM held back until it is done: a
    signal in the middle interrupted ``rmtree`` and left part of the directory under the command's
    "directories removed" (review47). The first one that came is raised again once the removal is
    complete. Held by handlers, not a signal mask: torch's threads would take a process's signal."""
    got: list[int] = []
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        shutil.rmtree(work, ignore_errors=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])
