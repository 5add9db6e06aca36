"""2 gloo ranks under ``trainguard run``: uninterrupted against a job whose rank ``crash_rank`` is
SIGKILLed after ``crash_step`` and that is started again at world size W. Prints each epoch's
global sample order (both runs) and, for W == 2, compares every rank's losses and final state.

    python bench/resume53/ddp.py NAME '{"steps":30,"crash_step":23,"crash_rank":1,"workers":2}' W
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from common import RUNS, compare, launch

name, cfg, w2 = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
base = RUNS / name
shutil.rmtree(base, ignore_errors=True)
a = {k: v for k, v in cfg.items() if k != "crash_step"} | {"out": str(base / "straight"), "ddp": True, "attempt": 0}
b = dict(cfg, out=str(base / "crashed"), ddp=True, attempt=0)
if (p := launch(a, 2, run_args=("--max-restarts", "0"))).returncode:
    raise SystemExit(p.stderr[-3000:])
print("first attempt rc", launch(b, 2, run_args=("--max-restarts", "0")).returncode)
if (p := launch(dict(b, attempt=1), w2, run_args=("--max-restarts", "0"))).returncode:
    raise SystemExit(p.stderr[-3000:])
with open(b["out"] + "/ckpt/events.jsonl") as f:
    restored = [json.loads(line)["step"] for line in f if '"restore"' in line][0]
print("restored step", restored)


def order(out: str, keep) -> dict[int, list[int]]:
    """Each epoch's samples in global order: per step, per micro-batch, element k of rank 0, 1, ..."""
    rows: dict = {}
    for r in range(3):
        if os.path.exists(f"{out}/seen-r{r}.jsonl"):
            with open(f"{out}/seen-r{r}.jsonl") as f:
                for line in f:
                    att, ep, st, idx = json.loads(line)
                    if keep(att, st):
                        rows.setdefault((st, ep), {}).setdefault(r, []).append(idx)
    per: dict[int, list[int]] = {}
    for st, ep in sorted(rows):
        ranks = rows[(st, ep)]
        for mb in range(len(ranks[0])):
            for k in range(len(ranks[0][mb])):
                per.setdefault(ep, []).extend(ranks[r][mb][k] for r in sorted(ranks))
    return per


A = order(a["out"], lambda att, st: True)
B = order(b["out"], lambda att, st: (att == 0 and st <= restored) or att == 1)
n = cfg.get("n", 48)
for ep in sorted(set(A) | set(B)):
    x, y = A.get(ep, []), B.get(ep, [])
    k = min(len(x), len(y))
    print(f"epoch {ep}: straight {len(x)}, resumed {len(y)} samples; same order on the common prefix {x[:k] == y[:k]}; "
          f"duplicates {len(y) - len(set(y))}, missing {sorted(set(range(n)) - set(y))}")
if w2 == 2:
    for r in range(2):
        compare(name, a["out"], b["out"], r)
