"""2 gloo ranks: ``trainguard run`` uninterrupted against the same job with ``--fault SPEC`` and
automatic restarts; compares every rank's losses and final state.

    python bench/resume53/restart.py NAME '{"steps":30,"async":true,"workers":2}' step=23,rank=1,kind=kill
"""

from __future__ import annotations

import json
import shutil
import sys

from common import RUNS, compare, launch

name, cfg, fault = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
base = RUNS / name
shutil.rmtree(base, ignore_errors=True)
outs = {}
for kind, args in (("straight", ("--max-restarts", "0")), ("fault", ("--fault", fault, "--max-restarts", "2"))):
    c = dict(cfg, out=str(base / kind), ddp=True, attempt=1)
    print(kind, "rc", launch(c, 2, run_args=args).returncode)
    outs[kind] = c["out"]
with open(outs["fault"] + "/ckpt/events.jsonl") as f:
    events = [json.loads(line) for line in f]
print("events:", [(e["event"], e.get("step")) for e in events if e["event"] in ("restore", "failure", "restart")])
for r in range(2):
    compare(name, outs["straight"], outs["fault"], r)
