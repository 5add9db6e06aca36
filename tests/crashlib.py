"""Child process for crash tests: commit step 1, then crash while saving step 2."""

from __future__ import annotations

import os
import sys

import torch

import trainguard as tg


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "model": model,
        "data": {"big": torch.randn(1_500_000, generator=g), "small": [torch.randn(10, generator=g) for _ in range(5)]},
        "progress": tg.StateDict(step=step),
    }


def main() -> None:
    root, point, kind, async_ = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "async"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=async_) as mgr:
        mgr.save(1, state_for(1))
        mgr.wait()
        os.environ["TRAINGUARD_CRASH_AT"] = point
        os.environ["TRAINGUARD_CRASH_KIND"] = kind
        mgr.save(2, state_for(2))
        mgr.wait()
    print("finished without crashing")


if __name__ == "__main__":
    main()
