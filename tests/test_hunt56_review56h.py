"""Session 56 review of ``elastic/heartclock.py`` (review56h): c10d heartbeats judged by this agent's clock. torch's
state holder syncs a state from a fake backend; this agent's wall and monotonic clocks are set by the test."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from trainguard.elastic import heartclock

NOW = datetime(2026, 12, 7, 12, 0, 0, tzinfo=timezone.utc)
B = dr._NodeDesc("node-b", 2, 0)


class _Backend:
    def __init__(self) -> None:
        self.state = dr._RendezvousState()

    def get_state(self):
        return pickle.dumps(self.state), 1


@pytest.fixture
def sync(monkeypatch):
    """``sync(beat, at)``: node B's heartbeat in the store is ``beat``; this agent syncs at ``at`` s (its monotonic
    clock, its wall clock ``NOW + at``). Returns whether B is still in the state (alive)."""
    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "_sanitize", dr._BackendRendezvousStateHolder._sanitize)
    heartclock.install()
    clock = [0.0]

    class _Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return NOW + timedelta(seconds=clock[0])

    monkeypatch.setattr(dr, "datetime", _Clock)
    monkeypatch.setattr(heartclock, "time", SimpleNamespace(monotonic=lambda: 1000.0 + clock[0]))
    backend = _Backend()
    settings = dr.RendezvousSettings("r", 1, 2, dr.RendezvousTimeout(), timedelta(seconds=1), 3)
    holder = dr._BackendRendezvousStateHolder(backend, settings, cache_duration=0)

    def run(beat: datetime, at: float) -> bool:
        backend.state.last_heartbeats = {B: beat}
        clock[0] = at
        holder.sync()
        return B in holder.state.last_heartbeats

    return run


@pytest.mark.parametrize("skew", [0.0, -10.0, 10.0, -250.0])
def test_a_dead_node_seen_late_is_dropped_when_its_heartbeat_expires(sync, skew: float) -> None:
    """Before: a node counted as alive for 3 s from when this agent saw its last heartbeat change, and this agent
    sees one at its next sync (every 1 to 2 s): a SIGKILLed node was dropped up to 2 s later than by torch's clocks
    (measured, real agents: 3.2 to 3.9 s after the SIGKILL, against 2.5 to 3.2 s before heartclock). Now its
    age counts from about when it was written (by how late this agent usually sees its heartbeats), whatever the
    node's clock."""
    node_clock = NOW + timedelta(seconds=skew)
    for t in (0.0, 1.0, 2.0):  # heartbeats written at t, seen at once
        assert sync(node_clock + timedelta(seconds=t), t + 0.05)
    last = node_clock + timedelta(seconds=3.0)  # its last heartbeat, written at 3 s, seen at 4.5 s
    assert sync(last, 4.5)
    assert not sync(last, 6.2)  # written 3.2 s ago (seen 1.7 s ago): dead


def test_a_live_node_is_not_dropped_early(sync) -> None:
    """Heartbeats written every 1 to 2 s and seen up to 2 s late stay alive; also once the node's clock is set back
    (its heartbeat times go back 5 s)."""
    for w, s in zip([0.0, 1.0, 3.0, 4.0, 6.0, 7.0], [0.1, 2.9, 3.1, 5.9, 6.1, 8.9]):
        assert sync(NOW + timedelta(seconds=w), s), (w, s)
    for w, s in ((8.0, 9.0), (9.0, 10.9), (10.0, 11.0)):  # its clock set back 5 s
        assert sync(NOW + timedelta(seconds=w - 5.0), s), (w, s)
        assert sync(NOW + timedelta(seconds=w - 5.0), s + 1.5), (w, s)


def test_a_node_first_seen_late_counts_from_the_first_sight(sync) -> None:
    assert sync(NOW - timedelta(seconds=2.0), 0.0)  # its heartbeat 2 s old at the first sight
    assert sync(NOW - timedelta(seconds=2.0), 2.9)
    assert not sync(NOW - timedelta(seconds=2.0), 3.1)


def test_a_heartbeat_beyond_far_is_dropped_with_a_message_saying_what_to_fix(sync, caplog) -> None:
    """Before: a node whose clock was more than 300 s (``FAR``) behind was dropped as dead at every sync, without a
    word (the job ran on with the nodes left, or hung). It still is (such a clock cannot be told from a node dead
    for 5 minutes), but the agent now says so, once."""
    caplog.set_level("WARNING", logger="trainguard")
    node_clock = NOW - timedelta(seconds=400)
    for t in (0.0, 1.0, 2.0, 3.0):
        assert not sync(node_clock + timedelta(seconds=t), t + 0.05)
    msgs = [r.getMessage() for r in caplog.records if "node-b" in r.getMessage()]
    assert len(msgs) == 1 and "400 s behind" in msgs[0] and "clock" in msgs[0], msgs
