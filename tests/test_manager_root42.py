"""An empty root (an unset variable: ``CheckpointManager(os.environ.get("CKPT_DIR", ""))``) is refused
before any I/O; before, the manager took the current directory for its run directory (its lock, event
log and step directories written there) and named the root ``''`` in its messages."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainguard as tg
from trainguard.permanent import is_permanent


def test_an_empty_root_is_refused_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"root=''\): pass the run directory") as info:
        with tg.CheckpointManager("", handle_signals=False):
            pass
    assert is_permanent(info.value)  # no restart fixes it (exit 78 under `trainguard run`)
    assert list(tmp_path.iterdir()) == []
