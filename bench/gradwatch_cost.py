"""What trainguard's PendingGradientsWarning bookkeeping (trainguard/gradwatch.py) costs a training
step on CPU: backward() and optimizer.step() timed apart, interleaved over models that are copies of
one another, medians of many repeats.

    PYTHONPATH=src python -m bench.gradwatch_cost [--reps 200] [--old path/to/old_gradwatch.py]

Variants: ``plain`` (no watch), ``watched`` (gradwatch.watch on the model's optimizer, as a
CheckpointManager does), ``hook`` (a no-op Python post-accumulate-grad hook per parameter: the
floor of any per-parameter hook), and with ``--old`` that module's ``watch`` (e.g. the per-parameter
hook version: ``git show 54800c5:src/trainguard/gradwatch.py > /tmp/old.py``). Models: 200 and 1000
Linear(16, 16) layers (400 and 2000 parameters) and a GPT-like 12-layer transformer (d=64, 149
parameters). One thread (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time

import torch
from torch import nn

from trainguard import gradwatch


def mlp(n: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(n)])


class GPT(nn.Module):
    def __init__(self, layers: int = 12, d: int = 64) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(256, d), nn.Embedding(64, d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def bench(name: str, base: nn.Module, x: torch.Tensor, reps: int, old: object | None) -> None:
    variants = {}
    for v in ["plain", "watched", "hook"] + (["old"] if old is not None else []):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        if v == "watched":
            gradwatch.watch({"optim": opt})
        elif v == "old":
            old.watch({"optim": opt})  # type: ignore[attr-defined]
        elif v == "hook":
            for p in m.parameters():
                p.register_post_accumulate_grad_hook(lambda p: None)
        variants[v] = (m, opt)
    bwd: dict[str, list[float]] = {v: [] for v in variants}
    stp: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(reps + 5):
        for v, (m, opt) in variants.items():
            opt.zero_grad(set_to_none=True)
            loss = m(x).float().square().mean()
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if r >= 5:
                bwd[v].append(t1 - t0)
                stp[v].append(t2 - t1)
    n = sum(1 for _ in base.parameters())
    for stat in (statistics.median, min):  # min: the least disturbed run, on a loaded machine
        b = {v: stat(x) * 1e6 for v, x in bwd.items()}
        s = {v: stat(x) * 1e6 for v, x in stp.items()}
        print(f"{name} ({n} params), {stat.__name__} of {reps}: plain backward {b['plain']:.0f} us, step {s['plain']:.0f} us")
        for v in variants:
            if v != "plain":
                extra = b[v] + s[v] - b["plain"] - s["plain"]
                print(f"  {v:8s} backward {b[v] - b['plain']:+7.0f} us ({100 * (b[v] / b['plain'] - 1):+5.1f}%), step {s[v] - s['plain']:+6.0f} us;"
                      f" per parameter {extra / n:+.2f} us, {100 * extra / (b['plain'] + s['plain']):+.1f}% of backward+step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--old", default=None)
    a = ap.parse_args()
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_gradwatch", a.old)
        old = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(old)  # type: ignore[union-attr]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bench("mlp-200", mlp(200), torch.randn(4, 16), a.reps, old)
    bench("mlp-1000", mlp(1000), torch.randn(4, 16), max(20, a.reps // 4), old)
    bench("gpt-12", GPT(), torch.randint(0, 256, (2, 32)), a.reps, old)


if __name__ == "__main__":
    main()
