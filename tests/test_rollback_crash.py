"""A rollback (``restore(state, step=N)``, or restore falling back behind unusable checkpoints)
abandons the newer checkpoints of the earlier timeline once this run's first save commits. A
crash at any point of that first save, or right after it, must resume from the right timeline:
before the commit, the earlier one (its newest step); after it, this run's (retention.set_aside).
"""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

import trainguard as tg

CHILD = textwrap.dedent(
    """
    import os, sys, torch, trainguard as tg
    root, point, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=mode == "async") as mgr:
        assert mgr.restore(state, step=2) == 2
        state["w"].fill_(30.0)
        if point != "none":
            os.environ["TRAINGUARD_CRASH_AT"] = point
        h = mgr.save(3, state)
        if point == "none":  # a crash after the commit, before the manager collects the save (async)
            h.result()
            os._exit(0)
        mgr.wait()
    """
)


def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def _first_run(root) -> None:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.full((4,), float(step * 10))})


def _resume(root) -> tuple[int | None, float]:
    state = {"w": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the debris warning
        with tg.CheckpointManager(root, async_save=False) as mgr:
            step = mgr.restore(state)
    return step, float(state["w"][0])


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "point, resumed",
    [("begin", 5), ("before_manifest", 5), ("after_manifest", 5), ("after_rename", 3), ("before_retention", 3), ("none", 3)],
)
def test_a_crash_in_or_after_a_rollbacks_first_save_resumes_the_right_timeline(tmp_path, forked, mode, point, resumed):
    """Before: the abandoned steps 4 and 5 were deleted only after step 3 committed (for an async
    save, when it was collected): a crash in between resumed from step 5, the timeline the
    operator had rolled back from."""
    if point == "none" and mode == "sync":
        pytest.skip("a sync save runs retention before it returns")
    root = tmp_path / "run"
    _first_run(root)
    log = tmp_path / "child.log"  # the child: forked by conftest.forked (torch imported once)
    code = forked(CHILD, root, point, mode, env={"TRAINGUARD_CRASH_KIND": "exit"}, log=log)
    assert code in (0, 17), (code, log.read_text())
    assert _resume(root) == (resumed, resumed * 10.0)
    # the next open cleaned up: the abandoned ones are gone or back, nothing is left aside
    want = ["step-000000001", "step-000000002", "step-000000003"] if resumed == 3 else [f"step-00000000{i}" for i in range(1, 6)]
    assert _steps(root) == want


def _rollback_and_fail(mgr: tg.CheckpointManager, state: dict, monkeypatch) -> None:
    """restore(step=2), then a save of step 3 that fails before its commit (an injected error)."""
    assert mgr.restore(state, step=2) == 2
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_manifest")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    with pytest.warns(UserWarning, match="save of step 3 failed"):
        assert mgr.save(3, state) is None
    monkeypatch.delenv("TRAINGUARD_CRASH_AT")


def test_a_failed_first_save_leaves_them_aside_until_a_later_save_commits(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _first_run(root)
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False, on_error="warn") as mgr:
        _rollback_and_fail(mgr, state, monkeypatch)
        left = _steps(root)  # the earlier run's 4 and 5 set aside, not deleted; its 3 not replaced
        assert left[:3] == ["step-000000001", "step-000000002", "step-000000003"] and len(left) == 5
        assert all(".abandoned-" in n for n in left[3:])
        state["w"].fill_(40.0)
        mgr.save(4, state)
        assert _steps(root) == ["step-000000001", "step-000000002", "step-000000004"]
    assert _resume(root) == (4, 40.0)


def test_without_a_rollback_nothing_is_set_aside(tmp_path):
    root = tmp_path / "run"
    _first_run(root)
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False) as mgr:
        assert mgr.restore(state) == 5
        mgr.save(6, state)
    assert _steps(root) == [f"step-00000000{i}" for i in range(1, 7)]
