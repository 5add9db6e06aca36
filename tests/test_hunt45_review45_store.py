"""Session 45's review of c64c550, on an object store (the fault proxy of ``test_hunt44_netfaults``
between s3fs and the session's SeaweedFS server)."""

from __future__ import annotations

import logging

import pytest

import trainguard as tg

pytest.importorskip("s3fs")
from test_hunt44_netfaults import _restores, _small, _url, proxy  # noqa: E402,F401  (the fixture)
from test_left45_store import recorded  # noqa: E402
from test_storage_s3 import weed  # noqa: E402,F401  (the session's server; skips without `weed`)
from trainguard.commit import list_steps  # noqa: E402


def test_retention_goes_on_past_a_step_whose_every_request_the_store_fails(proxy, caplog):  # noqa: F811
    """c64c550: after ``remove_tree``, retention asked whether the manifest was still there; when the
    store failed that request too (every request under ``step-000000002`` answered 500), the error ended
    the retention, and so every retention after it: steps 3 and 4 were never deleted, the run
    directory grew by one checkpoint per save (``retention_failed`` at each). Now step 2 is recorded as
    ``retention_kept`` and the steps after it are deleted as the policy says."""
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        events = recorded(mgr)
        for step in (1, 2, 3):
            mgr.save(step, _small(step))
        proxy.add(lambda method, target: "/step-000000002" in target, "status", arg=500)
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            for step in (4, 5, 6):
                mgr.save(step, _small(step))
        proxy.clear()
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [2, 5, 6]
        kinds = [(e["event"], e.get("step")) for e in events if e["event"].startswith("retention")]
        assert kinds == [("retention_delete", 1), ("retention_kept", 2), ("retention_kept", 2), ("retention_delete", 3),
                         ("retention_kept", 2), ("retention_delete", 4)], kinds
        assert "could not tell whether it was removed" in next(e["why"] for e in events if e["event"] == "retention_kept")
        events.clear()
        mgr.save(7, _small(7))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [6, 7]
    _restores(url, 7)
