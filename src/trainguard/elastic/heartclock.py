"""Rendezvous heartbeats judged by this agent's own clock, so that nodes whose wall clocks disagree still meet.

torch's c10d rendezvous keeps, for each node, the wall-clock time of its last keep-alive heartbeat, written by that
node with its own clock (``datetime.now``), and every node, at each sync of the state, drops the nodes whose time is
older than its own ``now - keep_alive_interval * keep_alive_max_attempt`` (``_BackendRendezvousStateHolder
._sanitize``): 3 s under ``trainguard run`` (torch: 15 s). Nodes' clocks set more than that apart (a node without
NTP, a VM whose clock drifted, a container host stepped back) broke the job; seen with one agent's rendezvous clock
set 10 s off (``tests/test_s56_heartclock.py``):

* the node behind was dropped as dead by the store's host at each of its syncs: the host formed the rendezvous and
  ran the job alone, at world size 1 under ``--nnodes 2``, with exit 0 (half the nodes training, silently), and the
  other agent exited 1 when the host's exit took the store;
* the node ahead dropped the other one: the rendezvous completed with a world size its nodes did not agree on, and
  the job hung.

:func:`install` (``launcher.install_agent_hooks``, once, in the agent) wraps ``_sanitize``: a node counts as alive
while its heartbeat's value changed within the expiry by this agent's monotonic clock (when this agent saw it change
at a sync), whatever the time it holds, and as dead once its value stayed the same for the expiry, also when its
time lies ahead. That sight comes at this agent's next sync, 1 to 2 s after the write: the age counts from how late
this agent usually sees the node's heartbeats (:func:`judge`), or a dead node was dropped up to 2 s later than by
torch (review56h). A heartbeat older than :data:`FAR` by this node's clock is judged by its time, as torch does (a
node dead long before this agent started watching is dropped at once, with a warning, once per node, that names
the node and says that if it is alive the clocks are wrong; a node first seen with an older heartbeat is dropped
after the expiry). The exit barrier (:mod:`.exitbarrier`) reads the same sanitized state. Limits: clocks
more than :data:`FAR` apart still fail; the last-call deadline of a ``--nnodes MIN:MAX`` rendezvous (set by one node,
read by the others) still moves by the skew.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

FAR = 300.0  # s: a heartbeat whose time is this far behind this node's clock is judged by its time alone
log = logging.getLogger("trainguard")
KEEP = 8  # a node's last heartbeats whose offsets say how late this agent usually sees one (judge)
_WARNED: set[Any] = set()  # the nodes whose heartbeat was over FAR behind, told once (judge)


def install() -> None:
    """Agent, once (before its first rendezvous): wrap torch's ``_BackendRendezvousStateHolder._sanitize`` (called
    at the end of each state sync, from the agent's thread and its keep-alive thread under the handler's lock)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    holder = getattr(dr, "_BackendRendezvousStateHolder", None)
    orig = holder.__dict__.get("_sanitize") if isinstance(holder, type) else None
    if orig is None or getattr(orig, "_tg_heartclock", False):
        return  # another torch: its own judgement

    def _sanitize(self: Any) -> None:
        state, settings = getattr(self, "_state", None), getattr(self, "_settings", None)
        beats = getattr(state, "last_heartbeats", None)
        try:
            expiry = settings.keep_alive_interval * settings.keep_alive_max_attempt  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            expiry = None
        if not isinstance(beats, dict) or not isinstance(expiry, timedelta):
            return orig(self)
        put = judge(self.__dict__.setdefault("_tg_beats", {}), beats, dr.datetime.now(dr.timezone.utc), expiry,
                    late=2 * settings.keep_alive_interval.total_seconds())  # type: ignore[union-attr]
        try:
            orig(self)
        finally:
            for node, beat in put.items():
                if node in beats:
                    beats[node] = beat  # the value read from the store: a state written back keeps it

    _sanitize._tg_heartclock = True  # type: ignore[attr-defined]
    holder._sanitize = _sanitize  # type: ignore[union-attr]


def judge(seen: dict[Any, Any], beats: dict[Any, Any], now: Any, expiry: timedelta, mono: float | None = None,
          late: float = 0.0) -> dict[Any, Any]:
    """Called by the wrapped ``_sanitize`` before torch's: note when each node's heartbeat value was seen to change
    (``seen``: node -> (value, monotonic time, recent offsets), kept on the state holder), and set in ``beats`` the
    time torch's judgement by clocks should see: ``now`` for a node alive (its heartbeat's age below ``expiry``), a
    time past the expiry for one dead. Returns the values replaced, for the caller to put back.

    A heartbeat's age is the time since this agent saw its value change, less how much later than usual it saw it
    (at most ``late`` s: the wrapper passes twice the keep-alive interval): this agent sees a heartbeat at its next
    sync (every 1 to 2 s), and a node's death was detected that much later than by torch's clocks (the survivor
    dropped a SIGKILLed node 3.2 to 3.9 s after the kill, against 2.5 to 3.2 s by torch's clocks; now 2.7 to 3.0 s,
    ``--nnodes 1:2``, 3 runs each). "Usual" is the least
    offset (this agent's monotonic time of a sight less the heartbeat's time) among the node's last :data:`KEEP`
    values, taken afresh when its time goes back (its clock set back)."""
    mono = time.monotonic() if mono is None else mono
    limit = expiry.total_seconds()
    put: dict[Any, Any] = {}
    for node, beat in list(beats.items()):
        try:
            behind, stamp = (now - beat).total_seconds(), beat.timestamp()
        except (TypeError, AttributeError):
            continue  # not a time torch wrote: torch's judgement
        prev = seen.get(node)
        if prev is None or prev[0] != beat:
            offs = [] if prev is None or stamp < prev[0].timestamp() else prev[2][-(KEEP - 1):]
            seen[node] = prev = (beat, mono, [*offs, mono - stamp])
        if behind > FAR:
            if node not in _WARNED:  # once per node and process: it is dropped, then may be sent again, at each sync
                _WARNED.add(node)
                log.warning("trainguard: the rendezvous heartbeat of node %s is %.0f s behind this node's clock (over "
                            "%.0f s), so it is taken for dead. If that node is alive, its clock or this one is wrong "
                            "by about that much: set the nodes' clocks right (NTP) and restart the job", node, behind,
                            FAR)
            continue
        sooner = min(max(prev[2][-1] - min(prev[2]), 0.0), late)
        alive = mono - prev[1] + sooner < limit
        if alive and behind > limit:
            put[node], beats[node] = beat, now
        elif not alive and behind <= limit:
            put[node], beats[node] = beat, now - expiry - expiry
    for node in list(seen):  # a copy taken under the GIL: another thread's sync may change ``seen``
        if node not in beats:
            seen.pop(node, None)
    return put
