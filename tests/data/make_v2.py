"""How tests/data/v2 was made (format_version 2: regular FSDP2 shards with index files). Never
regenerate it: old checkpoints must keep loading, and this fixture proves it.

``PYTHONPATH=src:tests python tests/data/make_v2.py tests/data/v2/step-000000009`` runs a
2-rank FSDP2 save (gloo on 127.0.0.1, through ``tests/dist_helper.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import trainguard as tg

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module, importable by the ranks


def golden_model() -> nn.Module:
    """5 rows over 2 ranks (parts of 3 and 2 rows); a 1-row weight (part 1 empty)."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 8 - i)
    return model


def golden_extra() -> dict:
    return {"plain": torch.arange(4, dtype=torch.int64), "note": "v2"}


def save_rank(rank: int, world: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = golden_model()
    fully_shard(model)
    tg.save(out, {"model": model, "progress": tg.StateDict(step=9), "extra": golden_extra()})


if __name__ == "__main__":
    from make_v2 import save_rank as fn  # a module-level function of an importable module

    from dist_helper import run_ranks

    run_ranks(fn, 2, str(Path(sys.argv[1]).resolve()), timeout=120)
