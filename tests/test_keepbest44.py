"""``KeepBest(metric)`` when no save passes that metric: rank 0 logs a warning once (before, it
kept the newest checkpoints without a word); a run that passes it is not warned."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import trainguard as tg


def _run(root: Path, keep: tg.RetentionPolicy, metrics: list[dict[str, float] | None]) -> list[int]:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for step, m in enumerate(metrics, 1):
            mgr.save(step, {"progress": tg.StateDict(step=step)}, metrics=m)
    return sorted(int(p[5:]) for p in os.listdir(root) if p.startswith("step-"))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "none of the" in r.getMessage()]


def test_keepbest_without_its_metric_is_warned_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainguard")
    kept = _run(tmp_path / "run", tg.KeepBest("val_loss", n=2) | tg.KeepLatest(2), [{"loss": 1.0}] * 6)
    assert kept == [5, 6]  # what it keeps without the metric: the newest
    (msg,) = _warnings(caplog)
    assert "'val_loss'" in msg and "metrics={'val_loss': value}" in msg, msg


def test_keepbest_with_its_metric_is_not_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainguard")
    losses = [5.0, 1.0, 4.0, 3.0, 2.0, 6.0]
    kept = _run(tmp_path / "run", tg.KeepBest("val_loss", n=2), [{"val_loss": v} for v in losses])
    assert kept == [2, 5, 6]  # the two best and the newest
    assert _warnings(caplog) == []
    # metrics passed only at some saves (evaluation steps): no warning once one holds it
    caplog.clear()
    kept = _run(tmp_path / "run2", tg.KeepBest("val_loss", n=1),
                [{"val_loss": 3.0}, None, None, {"val_loss": 1.0}, None])
    assert 4 in kept and _warnings(caplog) == []
