"""FSDP on gloo CPU ranks, session 21's review.

A sharded FSDP1 optimizer's refusals (another optimizer class, another number of parameter
groups) ran in its ``load_state_dict``, at the entry's turn: the model entry before it was
already loaded, so a refused load left the state half-modified. They now run before anything is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

import trainguard as tg
from test_fsdp1_19_review import _fsdp1, _full, _step

from dist_helper import attempt, run_ranks


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(v, b[k]) if isinstance(v, dict) else torch.equal(v, b[k]) for k, v in a.items())


def _refused_fsdp1(rank: int, world: int, root: str) -> dict:
    m, o = _fsdp1(0, False)
    _step(m, o, 0)
    tg.save(f"{root}/c", {"model": m, "optim": o})
    out = {}
    for name in ("sgd", "groups"):
        m2, o2 = _fsdp1(5, False)
        _step(m2, o2, 7)
        if name == "sgd":
            opt = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        else:  # 2 groups (one a flat parameter), saved: 1
            opt = torch.optim.Adam([{"params": [p]} for p in m2.parameters()], lr=1e-2)
        before = _full(m2)
        out[name] = attempt(lambda opt=opt, m2=m2: tg.load(f"{root}/c", {"model": m2, "optim": opt}))
        out[name]["unchanged"] = _same(before, _full(m2))  # the model entry, loaded before the optimizer
        out[name]["differs"] = not _same(before, _full(m))
    return out


def test_refused_sharded_fsdp1_optimizer_leaves_the_state_unchanged(tmp_path: Path) -> None:
    """Before: the class check ran in the adapter's load_state_dict, after the model entry was
    read: the error came with the model holding the checkpoint's parameters."""
    for r in run_ranks(_refused_fsdp1, 2, str(tmp_path), timeout=90):
        sgd, groups = r.value["sgd"], r.value["groups"]
        assert sgd["type"] == "CheckpointError" and "holds the state of a Adam optimizer" in sgd["msg"], sgd
        assert sgd["msg"].startswith("entry 'optim': ")
        assert groups["type"] == "CheckpointError" and "1 parameter group(s), the state's 2" in groups["msg"], groups
        for v in (sgd, groups):
            assert v["differs"] and v["unchanged"], v
