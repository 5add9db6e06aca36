"""Shared by the resume audit drivers: where things are, how to run, and a tensor-for-tensor compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "train.py")
ENV = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"), OMP_NUM_THREADS="1")
RUNS = Path(os.environ.get("RESUME53_RUNS", "/tmp/resume53-runs"))


def diff(x: Any, y: Any, path: str = "") -> list[str]:
    """The paths where two nested states differ (tensors by torch.equal, dtype and shape)."""
    if isinstance(x, torch.Tensor):
        same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        return [] if same else [path]
    if isinstance(x, dict):
        if not isinstance(y, dict) or set(x) != set(y):
            return [path + "(keys)"]
        return [q for k in x for q in diff(x[k], y[k], f"{path}/{k}")]
    if isinstance(x, list | tuple):
        if len(x) != len(y):
            return [path + "(len)"]
        return [q for i, (u, v) in enumerate(zip(x, y, strict=True)) for q in diff(u, v, f"{path}/{i}")]
    return [] if x == y or (x != x and y != y) else [path]


def losses(out: str, rank: int = 0) -> dict[int, list]:
    """Each step's records (loss as float.hex, lr), every attempt's, in order."""
    got: dict[int, list] = {}
    with open(f"{out}/losses-r{rank}.jsonl") as f:
        for line in f:
            step, *rest = json.loads(line)
            got.setdefault(step, []).append(rest)
    return got


def compare(name: str, a: str, b: str, rank: int = 0) -> bool:
    """Losses of every step (the last record) and the final state of run ``a`` against run ``b``."""
    la, lb = losses(a, rank), losses(b, rank)
    bad = [s for s in la if lb.get(s, [None])[-1] != la[s][-1]]
    again = [s for s in lb if len(lb[s]) > 1]
    d = diff(torch.load(f"{a}/final-r{rank}.pt", weights_only=False), torch.load(f"{b}/final-r{rank}.pt", weights_only=False))
    print(f"{name} rank {rank}: steps run twice {again[:1]}..{again[-1:]} loss-mismatch-steps={bad[:8]} state-diff={d[:8]}")
    print("RESULT", name, rank, "MATCH" if not bad and not d else "MISMATCH")
    return not bad and not d


def launch(cfg: dict, nproc: int = 0, extra_env: dict | None = None, run_args: tuple = ()) -> subprocess.CompletedProcess:
    """train.py in one process (nproc 0) or under ``trainguard run --nproc-per-node nproc``."""
    os.makedirs(cfg["out"], exist_ok=True)
    head = [sys.executable, TRAIN] if not nproc else [
        sys.executable, "-m", "trainguard", "run", "--nproc-per-node", str(nproc), *run_args,
        "--run-dir", cfg["out"] + "/ckpt", TRAIN]
    return subprocess.run([*head, json.dumps(cfg)], env=dict(ENV, **(extra_env or {})), capture_output=True,
                          text=True, timeout=500)
