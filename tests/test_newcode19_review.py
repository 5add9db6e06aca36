"""Review of session 19's new code (scheduler class record, deques, comm hooks, replica window):
what broke, and what held."""

from __future__ import annotations

from collections import Counter, deque
from pathlib import Path

import numpy as np
import torch
from torch import nn

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.errors import CheckpointError
from trainguard.storage import for_path

from dist_helper import run_ranks


class _Window:
    """A Stateful whose state holds deques inside a deque, a Counter and a numpy float in a deque."""

    def __init__(self) -> None:
        self.rows: deque = deque([deque([], maxlen=3), deque([], maxlen=3)], maxlen=4)
        self.counts: deque = deque([Counter()], maxlen=2)
        self.vals: deque = deque([np.float64(0.0)], maxlen=2)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "counts": self.counts, "vals": self.vals}

    def load_state_dict(self, sd: dict) -> None:
        self.rows, self.counts, self.vals = sd["rows"], sd["counts"], sd["vals"]


def test_deque_elements_keep_their_types(tmp_path: Path) -> None:
    w = _Window()
    w.rows[0].extend([1, 2])
    w.rows[1].append(3)
    w.counts[0]["a"] += 2
    w.vals[0] = np.float64(1.5)
    tg.save(tmp_path / "c", {"w": w})
    fresh = _Window()
    tg.load(tmp_path / "c", {"w": fresh})
    assert [type(r) for r in fresh.rows] == [deque, deque]
    assert [list(r) for r in fresh.rows] == [[1, 2], [3]] and fresh.rows[0].maxlen == 3
    assert type(fresh.counts[0]) is Counter and fresh.counts[0]["b"] == 0 and fresh.counts[0]["a"] == 2
    assert type(fresh.vals[0]) is np.float64 and fresh.vals[0] == 1.5


def _split_sched_rank(rank: int, world: int, root: str, cls_on_load: str) -> str:
    """Two pipeline stages (split_state=True): each rank its own stage's model and optimizer, and a
    scheduler entry on both; saved with OneCycleLR, loaded with ``cls_on_load`` on every rank."""
    import warnings

    from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR, StepLR

    torch.manual_seed(rank)
    stage = nn.Linear(4, 4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    sched = OneCycleLR(opt, max_lr=1.0, total_steps=10)
    if cls_on_load == "mixed":  # each stage its own kind of scheduler under one name
        sched = StepLR(opt, 3) if rank else sched
        cls_on_load = type(sched).__name__
    tg.save(f"{root}/c", {f"stage{rank}": stage, f"opt{rank}": opt, "sched": sched}, split_state=True)
    opt2 = torch.optim.SGD(stage.parameters(), lr=0.1)
    sched2 = {"OneCycleLR": lambda: OneCycleLR(opt2, max_lr=1.0, total_steps=10), "StepLR": lambda: StepLR(opt2, 3),
              "CosineAnnealingLR": lambda: CosineAnnealingLR(opt2, T_max=10)}[cls_on_load]()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tg.load(f"{root}/c", {f"stage{rank}": stage, f"opt{rank}": opt2, "sched": sched2}, split_state=True)
    except CheckpointError as e:
        return "refused: " + str(e)[:60]
    return f"loaded base_lrs={sched2.base_lrs}"


def test_split_state_keeps_scheduler_class(tmp_path: Path) -> None:
    """Under split_state a scheduler entry held by every stage lost its "class" record (the other
    stage's report replaced the manifest's entry): a CosineAnnealingLR took a OneCycleLR's
    base_lrs silently there, while refused without split_state. Fails before the fix."""
    res = run_ranks(_split_sched_rank, 2, str(tmp_path), "CosineAnnealingLR", timeout=90)
    assert all(r.value.startswith("refused: entry 'sched'") for r in res), [r.value for r in res]
    m = read_manifest(*for_path(str(tmp_path / "c")))
    assert m.objects["sched"].get("class") == "OneCycleLR"
    res = run_ranks(_split_sched_rank, 2, str(tmp_path / "same"), "OneCycleLR", timeout=90)
    assert all(r.value.startswith("loaded") for r in res), [r.value for r in res]
    # Stages with schedulers of other kinds under one name: one skeleton (rank 0's values) is saved, so
    # the stage whose scheduler is of another kind is refused, not given the other's attributes.
    res = run_ranks(_split_sched_rank, 2, str(tmp_path / "mixed"), "mixed", timeout=90)
    assert all(r.value.startswith("refused: ") for r in res), [r.value for r in res]
    assert res[1].value.startswith("refused: entry 'sched'")
