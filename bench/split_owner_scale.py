"""Rank 0's owner assignment of a split save (``splitplan.decide``) at scale: G groups (one rank
each), 6,000 shared 512x512 tensors and 96 own ones per group; prints the gather's size, the
answer every rank reads and the time of ``decide`` (docs/distributed.md, "Cost with many groups").

    PYTHONPATH=src python -m bench.split_owner_scale
"""

from __future__ import annotations

import json
import time

from trainguard.splitplan import decide

SHARED, OWN = 6000, 96


def items(g: int) -> list[list]:
    shared = [[f"optim/state/layers.{i}.w/exp_avg", "float32", [512, 512], 1 << 20] for i in range(SHARED)]
    return sorted(shared + [[f"experts.{g}.{j}", "float32", [64, 64], 16384] for j in range(OWN)])


def main() -> None:
    for groups in (64, 512, 1024):
        reports = [{"error": None, "items": items(g)} for g in range(groups)]
        sigs = [str(g) for g in range(groups)]
        gather = sum(len(json.dumps(r)) for r in reports)
        t = time.perf_counter()
        out = decide(reports, sigs)
        dt = time.perf_counter() - t
        answer = len(json.dumps({"value": out}))
        print(f"groups {groups}: gather {gather / 1e6:.1f} MB to rank 0, answer {answer / 1e3:.0f} kB read by each rank, decide {dt:.2f} s")


if __name__ == "__main__":
    main()
