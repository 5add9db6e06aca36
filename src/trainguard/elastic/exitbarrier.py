"""torch's exit barrier, waited in short store waits, and ended when the agents it waits for are gone.

An agent whose workers finished waits in torch's exit barrier (``SimpleElasticAgent._exit_barrier``) for the
other agents of its rendezvous round, up to ``exit_barrier_timeout`` (300 s): the agent hosting the c10d store
keeps it up for them. torch waits in one C++ store wait (the GIL released): a SIGTERM to the agent was acted on
only when that wait ended (over 4 minutes seen), and an agent whose peer had been SIGTERMed (it exits and never
checks in) waited the full 300 s for it.

:func:`install` (``launcher.install_agent_hooks``, once, in the agent) replaces it with :func:`exit_barrier`: the
same barrier keys (``store_util``'s count and last-member key: torch's agents and these interoperate), waited for
by a check every :data:`POLL` s (not a store wait with a short timeout: torch's C++ logs two warnings at each),
so the agent's signal handler runs between them. Each agent also sets a check-in key
of its own rendezvous node before it counts itself in. Between waits, with a c10d (dynamic) rendezvous, it reads
the rendezvous state: when every node of the round that has not checked in is gone (its keep-alive heartbeat
stopped: ``keep_alive_interval * keep_alive_max_attempt``, 3 s under ``trainguard run``; then for :data:`CONFIRM`
s more), nobody is left to wait for, and the barrier ends (an ``exit_barrier`` event with ``gone``: the count). A node that checked in and left
(its agent finished) is not waited for either way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("trainguard")
POLL = 0.5  # s: between two checks of the barrier's key; a stop signal is acted on at once (the sleep is interrupted)
CONFIRM = 2.0  # s: how long the nodes not checked in must stay without heartbeat (a peer's keep-alive thread starved
# for a moment on a loaded machine comes back: ending the barrier then took the store from an agent still running)
_IN = "trainguard_in/"  # the check-in key of a node, under torch's barrier prefix


def round_nodes(handler: Any) -> list[str]:
    """Agent, its rendezvous hook, right after a rendezvous completed: the nodes of the round (``str`` of torch's
    ``_NodeDesc``: ``addr_pid_localid``), from the c10d handler's state; [] for another rendezvous."""
    holder, lock = getattr(handler, "_state_holder", None), getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return []
    with lock:  # the keep-alive thread syncs the same state
        participants = getattr(holder.state, "participants", None)
        return sorted(str(n) for n in participants) if isinstance(participants, dict) else []


def _alive(handler: Any) -> set[str] | None:
    """The nodes whose keep-alive heartbeat is fresh, from a sync of the rendezvous state (what torch's
    ``num_nodes_waiting`` does, under the same lock); None when unknown."""
    holder, lock = getattr(handler, "_state_holder", None), getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return None
    with lock:
        holder.sync()  # drops the nodes whose heartbeat expired (torch's _sanitize)
        return {str(n) for n in holder.state.last_heartbeats}


def exit_barrier(agent: Any, events: Any) -> None:
    """Agent, in place of torch's ``_exit_barrier`` (its workers succeeded): wait for the other agents of the round,
    at most ``agent._exit_barrier_timeout`` s, a stop signal acted on within :data:`POLL` s; end when the nodes not
    checked in are all gone. Like torch's, a store error is logged, not raised; ``SignalException`` is raised."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.utils import store as store_util

    store, wg = agent._store, agent._worker_group
    handler, timeout = wg.spec.rdzv_handler, float(agent._exit_barrier_timeout)
    nodes, me = getattr(agent, "_tg_round", []), str(getattr(handler, "_this_node", ""))
    if getattr(handler, "_tg_store_lost", None) is not None:  # storelost.py: its host agent ended; none to wait for
        log.warning("trainguard: workers finished; the rendezvous store is gone (its host agent ended): no exit barrier")
        return
    log.info("trainguard: workers finished; waiting at most %s s for the other agents", timeout)
    start = time.monotonic()
    agent._in_exit_barrier = True
    try:
        if me and me in nodes:
            store.set(_TERMINAL_STATE_SYNC_ID + _IN + me, "1")
        last = store_util._barrier_nonblocking(store=store, world_size=wg.group_world_size,
                                               key_prefix=_TERMINAL_STATE_SYNC_ID)
        gone_since: float | None = None
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                log.warning("trainguard: the exit barrier timed out after %s s (an agent did not finish)", timeout)
                return
            if store.check([last]):
                return
            time.sleep(min(POLL, left))  # a stop signal interrupts it; a C++ wait logged 2 warnings per timeout
            gone = _gone(store, handler, nodes, me)
            if not gone:
                gone_since = None
                continue
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= CONFIRM:
                waited = round(time.monotonic() - start, 3)
                events.emit("exit_barrier", gone=len(gone), nodes=gone, waited_s=waited)
                log.warning("trainguard: the exit barrier ends after %s s: the agent(s) %s left without finishing "
                            "(no rendezvous heartbeat)", waited, gone)
                return
    except SignalException:
        raise
    except Exception:
        log.exception("trainguard: error waiting on the exit barrier after %.1f s", time.monotonic() - start)
    finally:
        agent._in_exit_barrier = False


def _gone(store: Any, handler: Any, nodes: list[str], me: str) -> list[str]:
    """The round's nodes that neither checked in nor heartbeat, when every node not checked in is such; else []."""
    if not nodes:
        return []
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID

    try:
        missing = [n for n in nodes if n != me and not store.check([_TERMINAL_STATE_SYNC_ID + _IN + n])]
        alive = _alive(handler) if missing else None
    except Exception:  # the store or the state unreadable: keep waiting (the barrier's wait says what is wrong)
        return []
    if alive is None or not missing or any(n in alive for n in missing):
        return []
    return missing


def install(events: Any) -> None:
    """Agent, once (``launcher.install_agent_hooks``): torch's ``SimpleElasticAgent._exit_barrier`` is
    :func:`exit_barrier`."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store as store_util

    orig = api.SimpleElasticAgent._exit_barrier
    parts = hasattr(store_util, "_barrier_nonblocking") and hasattr(api, "_TERMINAL_STATE_SYNC_ID")
    if getattr(orig, "_tg_barrier", False) or not parts:
        return  # a torch without the barrier's parts (their import in exit_barrier would fail the job): its own barrier

    def _exit_barrier(self: Any) -> None:
        exit_barrier(self, events)

    _exit_barrier._tg_barrier = True  # type: ignore[attr-defined]
    api.SimpleElasticAgent._exit_barrier = _exit_barrier  # type: ignore[method-assign]
