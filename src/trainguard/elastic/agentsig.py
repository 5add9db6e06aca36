"""The agent's handler of stop signals (``trainguard run``): torch's, raised once (moved from :mod:`.launcher`).

Called by :func:`.launcher.install_agent_hooks` (:func:`install_signal_once`, once, in the agent); torch installs
it as the agent's handler when it starts the first workers (``PContext.start``).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any

AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torch's agent turns into SignalException


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

