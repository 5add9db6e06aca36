"""Session 52's hunt for data loss in checkpoint retention (review52d): each test holds a
behaviour that was wrong before."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and "." not in n)


def test_a_second_manager_of_this_process_on_the_same_run_directory_through_another_path_is_refused(tmp_path: Path) -> None:
    """Two managers of one process on one run directory, the second through another path (reproduced
    with ``mount --bind``: ``/data/run`` and ``/mnt/run``; here the lock file hard-linked into another
    directory, which needs no privilege: the same inode under another real path). ``RunLock.acquire``
    refused a second manager by the lock file's real path only, and POSIX locks of one process do not
    conflict: the second opened, and its retention (``KeepLatest(2)``, no ``restore``) deleted the
    first one's step 10; the first one's next save then failed, saying its lock was held by "another
    job" (its own pid). Now the second ``open`` is refused before anything is removed."""
    run, other = tmp_path / "run", tmp_path / "other"
    other.mkdir()
    t = torch.zeros(4)
    kw = dict(save=tg.EveryNSteps(5), keep=tg.KeepLatest(2), handle_signals=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(run, **kw) as a:
            a.save(10, {"t": t})
            a.save(20, {"t": t})
            os.link(run / ".lock", other / ".lock")  # `other` is `run` through another path, as far as the lock goes
            b = tg.CheckpointManager(other, **kw)
            with pytest.raises(tg.LockedError, match="another CheckpointManager in this process .*another path"):
                b.open()
            assert _steps(run) == [10, 20]
            a.save(30, {"t": t})  # the first manager still holds its lock: saves go on
            assert _steps(run) == [20, 30]
