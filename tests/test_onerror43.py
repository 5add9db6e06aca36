"""``on_error="warn"`` and a state that no save can store (session 43).

Before, an ``object()`` in the state (``UnsupportedValueError``, permanent) failed every save with
a warning, so a job with ``on_error="warn"`` trained on for days with no checkpoint at all. A
permanent error that fails a second save in a row is raised now, on every rank; the first is
warned, because a metric refused once (``save(metrics=...)`` passes new values each call) need
not come again (tests/test_newcode19_review.py). Errors a later save can get past (a storage
error) are still warned however often they come."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.permanent import is_permanent

from dist_helper import run_ranks


def _state(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(3, 2), "extra": {"obj": object() if bad else 1}}


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))


def _failed(run: Path) -> list[int]:
    lines = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e["step"] for e in lines if e.get("event") == "save_failed"]


@pytest.mark.parametrize("async_save", [False, True])
def test_second_unsavable_save_in_a_row_is_raised(tmp_path: Path, async_save: bool) -> None:
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", async_save=async_save,
                              handle_signals=False) as mgr:
        mgr.save(1, _state(False))
        with pytest.warns(UserWarning, match=r"save of step 2 failed \(on_error='warn'\): extra/obj"):
            mgr.save(2, _state(True))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # raised, not warned
            with pytest.raises(tg.UnsupportedValueError, match="extra/obj") as got:
                mgr.save(3, _state(True))
        assert is_permanent(got.value)
    assert _steps(run) == ["step-000000001"]  # the last good checkpoint stays, and loads
    assert _failed(run) == [2, 3]
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.zero_()
    tg.load(run / "step-000000001", {"model": m, "extra": {"obj": 0}})
    assert torch.equal(m.weight, _state(False)["model"].weight)


def test_a_good_save_between_resets_the_count(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False) as mgr:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mgr.save(1, _state(True))
            mgr.save(2, _state(False))
            mgr.save(3, _state(True))  # not two in a row: warned again
            mgr.save(4, _state(False))
    assert [str(w.message)[:18] for w in seen if "on_error" in str(w.message)] == ["save of step 1 fai", "save of step 3 fai"]
    assert _steps(run) == ["step-000000002", "step-000000004"]


def test_repeated_errors_a_later_save_may_escape_are_still_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "begin")  # every save's write fails (not permanent)
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False) as mgr:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                mgr.save(step, _state(False))
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        mgr.save(4, _state(False))
    assert sum("on_error='warn'" in str(w.message) for w in seen) == 3
    assert _steps(run) == ["step-000000004"]


def _two_ranks(rank: int, world: int, root: str) -> list[str]:
    out = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False) as mgr:
            mgr.save(1, _state(False))
            for step in (2, 3):  # only rank 1 holds the unsavable value
                try:
                    mgr.save(step, _state(rank == 1))
                    out.append(f"{step}: warned" if any("on_error" in str(w.message) for w in seen) else f"{step}: saved")
                except tg.CheckpointError as e:
                    out.append(f"{step}: raised permanent={is_permanent(e)}")
    return out


def test_every_rank_raises_at_the_second_failure(tmp_path: Path) -> None:
    out = [r.value for r in run_ranks(_two_ranks, 2, str(tmp_path / "run"), timeout=90)]
    assert out == [["2: warned", "3: raised permanent=True"]] * 2, out
    assert _steps(tmp_path / "run") == ["step-000000001"]
