"""The rendezvous keep-alive thread, stopped before the agent's interpreter exits on a stop signal.

torch's c10d rendezvous handler (``DynamicRendezvousHandler``) sends a keep-alive heartbeat to the
rendezvous store from a daemon thread (``RendezvousKeepAliveTimer_*``, every ``keep_alive_interval``
s: ``trainguard run`` sets 1). ``launch_agent`` stops it in ``rdzv_handler.shutdown()``, except when the
agent raises ``SignalException`` (a SIGTERM/SIGINT/... to the agent): torch then leaves the rendezvous
open for the other nodes and the thread running, and its timer does not stop it at exit either
(``atexit = False``). A heartbeat whose store call (C++, the GIL released) returned while the agent's
interpreter was finalizing ended that thread with ``pthread_exit`` inside pybind11's GIL guard, and the
C++ runtime aborted the agent: "terminate called without an active exception", exit -6 (SIGABRT)
instead of 143 (1 run in 12 of SIGTERM to a 1-worker agent on a loaded 2-core machine).

:func:`install` also installs :mod:`.heartclock` (nodes whose wall clocks disagree).

:func:`install` (``launcher.install_agent_hooks``, once, in the agent) tracks the handlers whose
heartbeats started; :func:`stop` (``launcher.main``, on its way out) stops their threads and waits for a
heartbeat in flight, bounded. The rendezvous itself is not closed (torch's choice on a signal stands).

:func:`install` also makes a live agent put back a heartbeat the rendezvous state lost (:func:`_readd_op`):
torch's keep-alive op sends one only while the node's last heartbeat is still in the state, and any node's sync
drops a heartbeat older than ``keep_alive_interval * keep_alive_max_attempt`` (3 s) and writes that state back
with its own heartbeat. One stall of an agent's keep-alive thread past 3 s (a loaded or paused machine), at any
time in the job, so ended its heartbeats for good: the other agents' exit barrier (:mod:`.exitbarrier`) then
took it for gone while it still trained, the store's host left, and the job failed (RendezvousConnectionError).
"""

from __future__ import annotations

import weakref
from typing import Any

from . import heartclock

_HANDLERS: weakref.WeakSet[Any] = weakref.WeakSet()  # handlers whose keep-alive timer started (agent)


def install() -> None:
    """Agent, once: note each ``DynamicRendezvousHandler`` that starts its keep-alive heartbeats."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as cls

    orig = cls._start_heartbeats
    if getattr(orig, "_tg_keepalive", False):
        return

    def start(self: Any) -> None:
        _HANDLERS.add(self)
        orig(self)

    start._tg_keepalive = True  # type: ignore[attr-defined]
    cls._start_heartbeats = start
    _readd_op()
    heartclock.install()  # heartclock.py: heartbeats judged by this agent's clock, not by the nodes' clocks


def _readd_op() -> None:
    """Agent, once (:func:`install`): torch's keep-alive op (run by the keep-alive timer, only between a completed
    rendezvous and the next one or the handler's shutdown) also sends a heartbeat when this node's was dropped
    from the state (a stall past the expiry), unless the rendezvous is closed; torch's answers otherwise."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    op = getattr(dr, "_RendezvousKeepAliveOp", None)
    action = getattr(getattr(dr, "_Action", None), "KEEP_ALIVE", None)
    orig = op.__dict__.get("__call__") if isinstance(op, type) else None
    if action is None or orig is None or getattr(orig, "_tg_readd", False):
        return  # another torch: its own op (a dropped heartbeat then stays dropped)

    def call(self: Any, ctx: Any, deadline: float) -> Any:
        state = getattr(ctx, "state", None)
        beats = getattr(state, "last_heartbeats", None)
        if isinstance(beats, dict) and ctx.node not in beats and not getattr(state, "closed", False):
            return action  # torch's _keep_alive sets it again; the next round of the op finishes
        return orig(self, ctx, deadline)

    call._tg_readd = True  # type: ignore[attr-defined]
    op.__call__ = call


def stop(wait: float = 5.0) -> list[str]:
    """Agent, before it returns its exit code: stop the keep-alive threads still running and join each for at
    most ``wait`` s (a heartbeat in flight: a store call, milliseconds on a live store; the store's timeout on a
    frozen one, then the process may still abort). Returns the names of those still alive after the wait."""
    left = []
    for handler in list(_HANDLERS):
        timer = getattr(handler, "_keep_alive_timer", None)
        ctx, thread = getattr(timer, "_ctx", None), getattr(timer, "_thread", None)
        if ctx is None or thread is None:
            continue
        ctx.stop_event.set()  # what torch's timer.cancel() does, whose join is unbounded
        thread.join(wait)
        if thread.is_alive():
            left.append(thread.name)
    return left
