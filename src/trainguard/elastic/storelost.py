"""A rendezvous store that stops answering while this agent's workers still run: the workers' end waited for.

torch's agent asks the c10d rendezvous, at each round of its monitor loop while its workers are healthy
(``_invoke_run``: every ``--monitor-interval``, 0.1 s), how many nodes wait to join
(``DynamicRendezvousHandler.num_nodes_waiting``: a store read). The store lives in the agent that hosts it (the
first agent, ``is_host``). When that agent ends first, the read fails (``RendezvousConnectionError``) and torch's
agent fails at once: a traceback, its workers SIGTERMed, exit 1. It happens at the end of a preemption that reached
the host's node only (a spot reclaim, a ``kill`` of that node's agent): the ranks stop together and save, the
host's workers exit, its agent exits 143 and takes the store with it, and an agent whose workers were still ending
(a process teardown of 2 s: CUDA, DataLoader processes) exited 1, a crash to a requeue wrapper, instead of 143
(review55a: node B's worker ending 2 s after node A's; 1.0 s after: 143).

:func:`install` (``launcher.install_agent_hooks``, once, in the agent) makes that read answer 0 (no node waits) for
:data:`GRACE` s after the store's first failure, logging a ``store_lost`` event once: the monitor loop goes on
watching the workers (the store read again once a second), and their end is reported as it would be (128 + the stop signal after a preemption save, 0,
a failure: its restart then fails in the rendezvous, exit 1). Workers still healthy after the grace (training on
without the store) fail the agent as before. A read that succeeds again ends the grace.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("trainguard")
GRACE = 30.0  # s: torch's own shutdown timeout, the time it gives a worker between SIGTERM and SIGKILL
RETRY = 1.0  # s: between two reads of a store that failed (the monitor asks every 0.1 s)


def install(events: Any, grace: float | None = None) -> None:
    """Agent, once: ``DynamicRendezvousHandler.num_nodes_waiting`` answers 0 for ``grace`` (:data:`GRACE`) s after
    the rendezvous store stopped answering, then raises torch's error again."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as cls

    orig = cls.num_nodes_waiting
    if getattr(orig, "_tg_storelost", False):
        return

    def num_nodes_waiting(self: Any) -> int:
        first = self.__dict__.get("_tg_store_lost")
        if first is not None and time.monotonic() - self.__dict__.get("_tg_store_tried", first) < RETRY:
            return 0  # each failed read logs torch's C++ warning with its stack: once a second, not 10 times
        try:
            self._tg_store_tried = time.monotonic()
            n = orig(self)
        except RendezvousConnectionError as e:
            now, limit = time.monotonic(), GRACE if grace is None else grace
            if first is None:
                self._tg_store_lost = first = now
                events.emit("store_lost", error=f"{type(e.__cause__ or e).__name__}: {e.__cause__ or e}"[-500:],
                            grace_s=limit)
                log.warning("trainguard: the rendezvous store stopped answering (%s: its host agent ended?); "
                            "waiting at most %s s for this agent's workers to end", e.__cause__ or e, limit)
            if now - first >= limit:
                raise
            return 0
        self.__dict__.pop("_tg_store_lost", None)
        return n

    num_nodes_waiting._tg_storelost = True  # type: ignore[attr-defined]
    cls.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
