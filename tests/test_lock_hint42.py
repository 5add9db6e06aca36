"""A CheckpointManager opened without ``with`` and dropped without ``close()`` (a notebook cell that
reassigned its variable): its run directory's lock is released when the manager is collected, with a
ResourceWarning; before, it stayed held in the process for good and every later manager of that
directory got LockedError. One kept alive by its signal handlers cannot be collected: the
LockedError says how to close it, and that recipe works."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import trainguard
import trainguard as tg


def test_a_manager_dropped_without_close_releases_its_lock_when_collected(tmp_path: Path) -> None:
    mgr = tg.CheckpointManager(tmp_path / "run", handle_signals=False).open()
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        del mgr  # no reference cycle holds it: collected here (gc.collect() for one that a cycle holds)
        gc.collect()
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as again:  # before: LockedError
        assert again.latest_step() is None


def test_a_closed_manager_collected_later_does_not_warn_nor_release_the_next_ones_lock(tmp_path: Path) -> None:
    import warnings

    first = tg.CheckpointManager(tmp_path / "run", handle_signals=False).open()
    first.close()
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as second:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            del first
            gc.collect()
        with pytest.raises(tg.LockedError):  # second still holds it
            tg.CheckpointManager(tmp_path / "run", handle_signals=False).open()
        assert second.latest_step() is None


def test_the_hint_of_the_locked_error_closes_a_manager_its_signal_handlers_keep(tmp_path: Path) -> None:
    mgr = tg.CheckpointManager(tmp_path / "run").open()  # its SIGTERM/SIGINT handlers hold it
    del mgr
    gc.collect()
    with pytest.raises(tg.LockedError) as info:
        tg.CheckpointManager(tmp_path / "run", handle_signals=False).open()
    hint = str(info.value).split("in a notebook: `")[1].rstrip(")`")
    exec(hint, {"trainguard": trainguard, "gc": gc})
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as again:
        assert again.latest_step() is None
