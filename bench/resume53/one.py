"""One process: an uninterrupted run against one killed (SIGKILL after ``crash_step``, a SIGTERM at
``preempt_step``, or a TRAINGUARD_CRASH_AT fault point) and resumed.

    python bench/resume53/one.py NAME '{"steps":30,"crash_step":23,"sched":"onecycle"}' [K=V,K=V]
"""

from __future__ import annotations

import json
import shutil
import sys

from common import RUNS, compare, launch

name, cfg = sys.argv[1], json.loads(sys.argv[2])
crash_env = dict(kv.split("=", 1) for kv in sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else {}
base = RUNS / name
shutil.rmtree(base, ignore_errors=True)
straight = {k: v for k, v in cfg.items() if k not in ("crash_step", "preempt_step")}
straight["out"] = str(base / "straight")
if (p := launch(straight)).returncode:
    raise SystemExit(p.stderr[-3000:])
crashed = dict(cfg, out=str(base / "crashed"))
p = launch(crashed, extra_env=crash_env)
print("first attempt rc", p.returncode)
if (p := launch(crashed)).returncode:
    raise SystemExit(p.stderr[-3000:])
for line in p.stderr.splitlines():
    if "Warning" in line and "stale lock" not in line:
        print("  warn:", line[:300])
compare(name, straight["out"], crashed["out"])
