"""Cost of tie detection at capture time: ``python -m bench.tie_cost [SRC]`` times
``capture`` of states of 10,000 small tensors without a tie (a flat dict of 10,000 entries,
and one entry of 10,000 tensors) in this checkout and, given SRC (a trainguard ``src``
directory, e.g. an older commit's worktree), in that one too, each in its own subprocess,
alternating, with the garbage collector paused as a save pauses it. Prints the best and median
of 30 captures, milliseconds per 10,000 tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUNS = 30
ROUNDS = 3

_CHILD = f"""
import gc, statistics, time, torch
from trainguard.capture import capture
from trainguard.dist import DistContext
ctx = DistContext.current()
states = {{
    "flat": {{f"t{{i}}": torch.randn(16) for i in range(10_000)}},
    "nested": {{"model": {{f"layer{{i}}.weight": torch.randn(16) for i in range(10_000)}}}},
}}
for name, st in states.items():
    capture(st, ctx=ctx)
    gc.collect(); gc.disable()
    ts = []
    for _ in range({RUNS}):
        t0 = time.perf_counter(); capture(st, ctx=ctx); ts.append(time.perf_counter() - t0)
    gc.enable()
    print(f"{{name}}: best {{min(ts) * 1e3:.2f}} ms, median {{statistics.median(ts) * 1e3:.2f}} ms")
"""


def main() -> None:
    here = str(Path(__file__).resolve().parents[1] / "src")
    srcs = [("this checkout", here)] + ([("SRC", sys.argv[1])] if len(sys.argv) > 1 else [])
    for r in range(ROUNDS):
        for label, src in srcs:
            out = subprocess.run([sys.executable, "-c", _CHILD], env={"PYTHONPATH": src, "PATH": ""},
                                 capture_output=True, text=True, timeout=600, check=True).stdout
            for line in out.splitlines():
                print(f"round {r}, {label}: {line}")


if __name__ == "__main__":
    main()
