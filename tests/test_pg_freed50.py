"""trainguard kept a reference to the default process group (its context cache) that outlived
``destroy_process_group``: gloo's group was then torn down during interpreter finalization, where
a worker thread taking the GIL aborts the rank ("terminate called without an active exception";
a torchrun ``trainguard bench`` rank in CI of 2026-12-07). After a user's
``destroy_process_group`` no reference of trainguard's keeps the group alive."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

import trainguard as tg

from dist_helper import run_ranks


def _save_then_destroy(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    tg.save(f"{root}/a", {"w": torch.full((4,), 3.0), "rng": tg.RNGState()}, timeout=30)
    got = {"w": torch.zeros(4), "rng": tg.RNGState()}
    tg.load(f"{root}/a", got, timeout=30)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    return {"alive": group() is not None, "w": got["w"].tolist()}


def test_destroy_process_group_frees_the_group_after_trainguard_collectives(tmp_path: Path) -> None:
    res = run_ranks(_save_then_destroy, 2, str(tmp_path), timeout=120)
    for r in res:
        assert r.ok, r.error
        assert r.value["w"] == [3.0] * 4
        assert not r.value["alive"], f"rank {r.rank}: the process group outlived destroy_process_group"
