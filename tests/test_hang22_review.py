"""A rank stuck inside a trainguard call (its own ``state_dict()`` or ``load_state_dict()`` blocks; its
heartbeat beats) on real gloo ranks: the others' error at the timeout names it as stuck *there*, not as
a rank that "did not arrive" / "must call save under `if rank == 0:`", and the ranks stay in step.

The stuck rank waits on a file that rank 0 creates once its own call raised: the order is fixed by
the test, not by timing (every wait is bounded by run_ranks' timeout)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, run_ranks


class _Blocking:
    """A Stateful whose ``state_dict`` (``when="save"``) or ``load_state_dict`` (``"load"``) blocks
    on rank 1, once armed, until ``release`` exists."""

    def __init__(self, rank: int, when: str, release: str) -> None:
        self.rank, self.when, self.release, self.armed, self.v = rank, when, release, False, torch.zeros(3)

    def _block(self, when: str) -> None:
        if self.armed and self.when == when and self.rank == 1:
            self.armed = False
            while not os.path.exists(self.release):  # bounded by run_ranks' timeout
                threading.Event().wait(0.02)

    def state_dict(self) -> dict:
        self._block("save")
        return {"v": self.v}

    def load_state_dict(self, sd: dict) -> None:
        self._block("load")
        self.v.copy_(sd["v"])


def _state(rank: int, when: str, root: str) -> dict:
    torch.manual_seed(0)
    return {"model": nn.Linear(4, 4), "hook": _Blocking(rank, when, f"{root}.release")}


def _stuck_in_state_dict(rank: int, world: int, root: str, async_: bool) -> dict:
    def save(step: int) -> Any:
        h = tg.save(f"{root}/step-{step:09d}", state, timeout=2, async_=async_)
        return h.result() if async_ else h

    state = _state(rank, "save", root)
    save(1)
    state["hook"].armed = True
    out = {"stuck": attempt(lambda: save(2))}
    if rank == 0:
        Path(f"{root}.release").touch()
    out["next"] = attempt(lambda: save(3))
    return out


@pytest.mark.parametrize("async_", [False, True])
def test_a_rank_stuck_in_its_state_dict_is_named_as_stuck_there(tmp_path: Path, async_: bool) -> None:
    root = tmp_path / "run"
    root.mkdir()
    res = run_ranks(_stuck_in_state_dict, 2, str(root), async_, timeout=60)
    stuck = [r.value["stuck"] for r in res]
    # Before: "begin: rank(s) [1] did not arrive within 2 s. Every rank must call save/load with the
    # same step and state (e.g. not under `if rank == 0:`)", while rank 1 was inside save().
    assert all(s["type"] == "RankFailureError" and s["ranks"] == [1] for s in stuck), stuck
    assert stuck[0]["msg"] == stuck[1]["msg"], stuck
    msg = stuck[0]["msg"]
    assert "rank 1 still capturing its state for the save (state_dict() and hooks)" in msg, msg
    assert "did not arrive" not in msg and "if rank == 0" not in msg, msg
    assert [r.value["next"] for r in res] == [{"type": None}] * 2, [r.value for r in res]
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001", "step-000000003"]


def _stuck_in_load_state_dict(rank: int, world: int, root: str) -> dict:
    state = _state(rank, "load", root)
    kw: dict[str, Any] = dict(save=tg.EveryNSteps(1), handle_signals=False, timeout=2)
    with tg.CheckpointManager(root, **kw) as mgr:
        mgr.save(1, state)
    state["hook"].armed = True
    with tg.CheckpointManager(root, **kw) as mgr:
        out = {"stuck": attempt(lambda: mgr.restore(state))}
        if rank == 0:
            Path(f"{root}.release").touch()
        out["again"] = mgr.restore(state)
    return out


def test_a_rank_stuck_in_its_load_state_dict_is_named_as_stuck_loading(tmp_path: Path) -> None:
    root = tmp_path / "run"
    res = run_ranks(_stuck_in_load_state_dict, 2, str(root), timeout=60)
    stuck = [r.value["stuck"] for r in res]
    # Before: "loaded: rank(s) [1] did not arrive within 2 s. Every rank must call save/load ...".
    assert all(s["type"] == "RankFailureError" and s["ranks"] == [1] for s in stuck), stuck
    assert stuck[0]["msg"] == stuck[1]["msg"], stuck
    msg = stuck[0]["msg"]
    assert "rank(s) [1] did not finish reading its data and loading it into its state" in msg, msg
    assert "did not arrive" not in msg, msg
    assert [r.value["again"] for r in res] == [1, 1]


def _rank1_loop_ends_early(rank: int, world: int, root: str, kind: str) -> dict:
    """Rank 1's loop ends a step early (uneven data): it closes its manager and goes on (evaluation:
    here, waiting for rank 0's outcome); rank 0 saves step 3."""
    kw: dict[str, Any] = dict(save=tg.EveryNSteps(1), handle_signals=kind == "decide", async_save=kind == "async", timeout=20)
    saved: list[int] = []

    def train() -> None:  # rank 0's failed save leaves the `with` with its error: no closing round
        with tg.CheckpointManager(root, **kw) as mgr:
            for step in range(1, 4 if rank == 0 else 3):
                mgr.save(step, {"x": torch.full((2,), float(step))})
                saved.append(step)

    out = {"train": attempt(train), "saved": saved}
    if rank == 0:
        Path(f"{root}.done").touch()
    else:
        while not os.path.exists(f"{root}.done"):  # bounded by run_ranks' timeout
            threading.Event().wait(0.02)
    return out


@pytest.mark.parametrize("kind", ["sync", "decide", "async"])  # decide: a per-step round first; async: the save's thread waits
def test_a_rank_that_closed_its_manager_while_rank_0_saves_fails_the_save_at_once(tmp_path: Path, kind: str) -> None:
    # Before: rank 1's close() returned at once (rank 0 collects "close") and deleted its "at" key,
    # so rank 0's save of step 3 waited the whole timeout (600 s by default; 20 s here) and said
    # "rank(s) [1] did not arrive ... (e.g. not under `if rank == 0:`)".
    root = tmp_path / "run"
    res = run_ranks(_rank1_loop_ends_early, 2, str(root), kind, timeout=60)
    started = [1, 2, 3] if kind == "async" else [1, 2]  # async: step 3's save fails in close()'s wait
    assert [r.value["saved"] for r in res] == [started, [1, 2]], [r.value for r in res]
    assert res[1].value["train"] == {"type": None}, res[1].value
    three = res[0].value["train"]
    assert three["type"] == "RankFailureError" and three["ranks"] == [1], three
    assert "rank 1 called 'close' (CheckpointManager.close)" in three["msg"], three
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000000001", "step-000000002"]


def _save_once(rank: int, world: int, root: str) -> dict:
    return attempt(lambda: tg.save(f"{root}/step-000000001", {"x": torch.zeros(2)}))


@pytest.mark.parametrize("env", [{"TRAINGUARD_TIMEOUT": "10m"}, {"TRAINGUARD_DEAD_AFTER": "-1"}])
def test_a_timeout_setting_that_is_not_seconds_is_refused_naming_it(tmp_path: Path, env: dict) -> None:
    # Before: "could not convert string to float: '10m'" (no variable named), and for
    # TRAINGUARD_DEAD_AFTER=-1 "the c10d store stopped answering ... rank 0 died or hangs".
    ((name, value),) = env.items()
    res = run_ranks(_save_once, 2, str(tmp_path), timeout=60, env=env)
    for r in res:
        assert r.value["type"] == "ValueError" and f"{name}={value!r}" in r.value["msg"], r.value
        assert "seconds > 0" in r.value["msg"], r.value
    assert not list(tmp_path.iterdir())
