"""The agent's handler of stop signals (``trainguard run``): torch's, raised once, from the agent's start.

Called by :func:`.launcher.install_agent_hooks` (:func:`install_signal_once`, once, in the agent), which torch
installs as the agent's handler when it starts the first workers (``PContext.start``), and by
:func:`.launcher.main` (:func:`install_early`: the same handler before torch's agent runs, so a signal during
the first rendezvous is acted on too). The handler first tells :mod:`.sigwatch` that the main thread took the
signal up (:func:`.sigwatch.take`): a thread ends the agent when it does not (a C++ store call). While the agent
closes the workers of a failure (:func:`deferred`), a stop signal waits for that close (bounded: its grace).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from . import sigwatch

AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torch's agent turns into SignalException


_DEFER: list[bool] = []  # not empty while the agent closes the workers of a failure (deferred)


@contextlib.contextmanager
def deferred(on: bool = True) -> Iterator[None]:
    """Agent, around its bounded close of a failed group's workers (``reap.bound_failure_close``, the launcher's
    ``ProcessContext.join`` hook): a first stop signal then is kept for ``raise_lost`` (the monitor hook, after it
    logged the ``failure`` event) instead of raised. Raised there, it cut the close short: no ``failure`` event,
    and a peer that ignores SIGTERM, SIGKILLed after the 1 s grace otherwise, waited the 30 s shutdown timeout."""
    if not on:
        yield
        return
    _DEFER.append(True)
    try:
        yield
    finally:
        _DEFER.pop()


def install_signal_once() -> Any:
    """Agent (:func:`.launcher.install_agent_hooks`): a stop signal while the agent stops its workers for an
    earlier one is reported, not raised (torch's handler: a 2nd cut the wait for the workers' save,
    a 3rd ended the agent mid-save). The wait stays bounded: ``--shutdown-timeout``, then SIGKILL.
    Returns ``raise_lost``, for the agent's monitor and rendezvous hooks: it raises again a signal's
    ``SignalException`` that Python swallowed (raised in fork's at-fork hooks while the agent forked a worker)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    torch_handler, orig_shutdown, agent = api._terminate_process_handler, LocalElasticAgent._shutdown, os.getpid()
    seen: list[int] = []
    stopping: list[bool] = []  # not empty while the agent stops its workers
    lost: list[int] = []  # a signal whose raise may have been swallowed

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != agent:  # a forked worker inherited it: die of the signal (torch's raise, in
            signal.signal(signum, signal.SIG_DFL)  # fork's at-fork hooks, was swallowed: 30 s to SIGKILL)
            return os.kill(os.getpid(), signum)
        if not sigwatch.take():  # the watcher thread already ends the agent (the main thread was in a C++ call)
            return sigwatch.park()
        if _DEFER:  # closing the workers of a failure (1 s grace, SIGKILL): its failure event first
            if not lost:
                seen.append(signum)
                lost.append(signum)  # raised by raise_lost after the monitor round logged the failure
            return
        if not (seen and stopping):
            seen.append(signum)
            lost.append(signum)  # until raise_lost: torch's run() acting on the raise never returns to it
            torch_handler(signum, frame)  # raises SignalException: the agent stops its workers
        print(f"trainguard run: {signal.Signals(signum).name} again; still waiting for the workers to stop "
              "(their save), SIGKILL after the shutdown timeout", file=sys.stderr, flush=True)

    @functools.wraps(orig_shutdown)  # its signature: stop_bounded asks it whether torch's takes timeout
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> None:
        stopping.append(True)
        try:
            orig_shutdown(self, *args, **kwargs)
        finally:
            stopping.pop()

    def raise_lost() -> None:
        if lost:
            torch_handler(lost.pop(), None)

    api._terminate_process_handler = handler
    LocalElasticAgent._shutdown = shutdown  # type: ignore[method-assign]
    return raise_lost


def install_early() -> list[signal.Signals]:
    """Agent (:func:`.launcher.main`), main thread, before torch's agent runs: the agent's handler (torch's
    ``_terminate_process_handler``, as :func:`install_signal_once` wrapped it) for :data:`AGENT_SIGNALS` now. torch
    installs it only when it starts the first workers: a SIGTERM during the first rendezvous (agents waiting for
    their peers, a job cancelled then) killed the agent by the signal's default action (no ``agent_exit``, its
    ``trainguard-logs-*`` directory left), a SIGINT ended it with a ``KeyboardInterrupt`` traceback. A signal this
    process ignores (``nohup``: SIGHUP) stays ignored. Returns the signals handled; :mod:`.sigwatch` covers a main
    thread that cannot run the handler (inside a C++ call)."""
    from torch.distributed.elastic.multiprocessing import api

    sigs = [getattr(signal, n) for n in AGENT_SIGNALS if hasattr(signal, n)]
    handled = [s for s in sigs if signal.getsignal(s) is not signal.SIG_IGN]
    for s in handled:
        signal.signal(s, api._terminate_process_handler)
    return handled
