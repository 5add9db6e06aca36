"""Session 45: retention on an object store that refuses a delete (the fault proxy of
``test_hunt44_netfaults`` between s3fs and the session's SeaweedFS server)."""

from __future__ import annotations

import logging

import pytest

import trainguard as tg

pytest.importorskip("s3fs")
from test_hunt44_netfaults import _restores, _small, _url, proxy  # noqa: E402,F401  (the fixture)
from test_storage_s3 import weed  # noqa: E402,F401  (the session's server; skips without `weed`)
from trainguard.commit import list_steps  # noqa: E402


def recorded(mgr: tg.CheckpointManager) -> list[dict]:
    """The events ``mgr`` emits from here on (an object store's run has no events.jsonl), as dicts."""
    events: list[dict] = []
    emit = mgr.events.emit
    mgr.events.emit = lambda event, **f: events.append({"event": event, **f}) or emit(event, **f)  # type: ignore[method-assign]
    return events


def test_retention_whose_delete_the_store_refuses_records_no_delete_and_catches_up(proxy, caplog):  # noqa: F811
    """Before: ``retention_delete`` was emitted for a step every DELETE of which was answered 500
    (it stayed, listed by ``trainguard ls``), and the log said ``[Errno 121] ...``; now the event is
    ``retention_kept``, the log names the HTTP answer, and the next retention removes it."""
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        events = recorded(mgr)
        for step in (1, 2, 3):
            mgr.save(step, _small(step))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [2, 3]
        proxy.add(lambda method, target: method in ("DELETE", "POST") and "/step-000000002" in target, "status", arg=500)
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            mgr.save(4, _small(4))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [2, 3, 4]
        kinds = [(e["event"], e.get("step")) for e in events if e["event"].startswith("retention")]
        assert kinds == [("retention_delete", 1), ("retention_kept", 2)], kinds
        assert "the object store answered HTTP 500 (InternalError)" in caplog.text, caplog.text
        proxy.clear()
        events.clear()
        mgr.save(5, _small(5))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [4, 5]
        assert sorted((e["event"], e["step"]) for e in events if e["event"].startswith("retention")) == [
            ("retention_delete", 2), ("retention_delete", 3)]
    _restores(url, 5)
