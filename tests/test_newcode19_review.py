"""Review of session 19's new code (scheduler class record, deques, comm hooks, replica window):
what broke, and what held."""

from __future__ import annotations

from collections import Counter, deque
from pathlib import Path

import numpy as np

import trainguard as tg


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
