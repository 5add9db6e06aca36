"""Review of the changes since bd5b966 (hunt42 review42)."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

from trainguard import layout
from trainguard.runlock import RunLock


def _stale_lock(d: Path) -> None:
    d.mkdir(exist_ok=True)
    (d / layout.LOCK).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "since": 0}))


def test_a_lock_taken_over_in_a_thread_whose_target_is_trainguard_names_trainguard_not_threading(tmp_path: Path) -> None:
    """``userframe.user_stacklevel`` documents 1 (the calling function) when no user frame is above:
    a thread whose target is trainguard's. The walk stopped at ``threading.py``'s ``Thread.run``
    instead, so the warning named ``threading.py:982``."""
    _stale_lock(tmp_path / "run")
    lock = RunLock(str(tmp_path / "run"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=lock.acquire)
        t.start()
        t.join()
    lock.release()
    taken = [w for w in caught if "stale" in str(w.message) or "lock" in str(w.message)]
    assert taken, [str(w.message) for w in caught]
    assert os.path.basename(taken[0].filename) == "runlock.py", taken[0].filename


def test_a_lock_taken_over_from_the_users_code_still_names_the_users_line(tmp_path: Path) -> None:
    _stale_lock(tmp_path / "run")
    lock = RunLock(str(tmp_path / "run"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lock.acquire()  # this line
    lock.release()
    assert caught and caught[0].filename == __file__
