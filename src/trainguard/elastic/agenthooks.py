"""The agent's hooks into torch's elastic agent: ``install_agent_hooks`` wraps its methods to log events,
bound the stop wait and record each restart's reason (``RESTARTS``) and the agent (``AGENT``).

Moved out of ``launcher.py``, which imports and re-exports every name here: ``launcher.main`` calls
:func:`install_agent_hooks` once, in the agent process, before torch's agent runs; ``main``/``_run_agent``
read ``RESTARTS`` and ``AGENT`` (lists filled in place by the hooks) for the job's exit message and
``sigwatch.exit_stuck``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ..events import EventLog
from . import agentsig, errfiles, exitbarrier, keepalive, masterport, reap, storelost
from .agentsig import install_signal_once
from .reap import close_done, end_trees, expose_dead, set_finished, stop_bounded
from .stops import (
    STOP_FILE_ENV,
    clear,
    exit_cause,
    failure_detail,
    first_failure,
    no_restart,
    root_failure,
    stop_code,
)

FAIL_GRACE = 1.0

RESTARTS: list[str] = []  # the reason of each restart of this agent's workers (main's message when the job failed)
AGENT: list[Any] = []  # torch's agent, once its first rendezvous began; then True once a rendezvous completed


def install_agent_hooks(events: EventLog, stop_timeout: float) -> None:
    """Wrap torch's agent methods (in this process) to log events and bound the stop wait."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext
    from torch.multiprocessing.spawn import ProcessContext, ProcessException

    if getattr(LocalElasticAgent, "_trainguard_hooked", False):
        return
    reap.bound_failure_close(SubprocessContext, FAIL_GRACE), reap.exit_when_returned(), masterport.hold(), keepalive.install()  # their modules
    errfiles.install(MultiprocessContext)  # errfiles.py: no pytorch-errorfile-*.pickle left in /tmp
    exitbarrier.install(events)  # exitbarrier.py: a signal acted on in the exit barrier; gone peers not waited for
    storelost.install(events)  # storelost.py: the store's host ended first: this agent's workers' end waited for
    raise_lost = install_signal_once()
    orig_rdzv = SimpleElasticAgent._rendezvous
    orig_monitor = LocalElasticAgent._monitor_workers
    orig_restart = SimpleElasticAgent._restart_workers
    orig_join = ProcessContext.join
    orig_close = MultiprocessContext._close

    def _rendezvous(self: Any, wg: Any) -> None:
        t0 = time.time()
        AGENT[:1] = [self]  # exit_stuck: the workers to stop
        orig_rdzv(self, wg)
        AGENT[1:] = [True]  # main's message on a stop signal: workers were started
        self._tg_round = exitbarrier.round_nodes(wg.spec.rdzv_handler)  # the nodes its exit barrier waits for
        raise_lost()
        clear(os.environ.get(STOP_FILE_ENV))  # workers start next: a stop the restart's SIGTERM caused is forgotten
        world = wg.workers[0].world_size if wg.workers else None
        events.emit("rendezvous", world_size=world, nodes=wg.group_world_size, node_rank=wg.group_rank,
                    seconds=round(time.time() - t0, 3))

    def _monitor(self: Any, wg: Any) -> Any:
        raise_lost()  # a stop signal the agent received while it forked the workers: it stops them now
        t0, result = time.time(), orig_monitor(self, wg)  # the poll that sees a failure stops the others, then returns
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            if stop_code(None, [f.exitcode for f in result.failures.values()]) is not None:
                self._remaining_restarts = 0  # exited 128 + a stop signal after their save: a preemption, no failure
                raise_lost()
                return result
            first = first_failure(result.failures)
            events.emit("failure", rank=first, cause=exit_cause(result.failures[first].exitcode), stop_s=round(time.time() - t0, 6),
                        failures={str(r): exit_cause(f.exitcode) for r, f in result.failures.items()}, **failure_detail(result.failures[first]))
            if no_restart(result.failures):
                self._remaining_restarts = 0  # exit 78: the same error at every restart (permanent.py)
        raise_lost()  # a stop signal during the failure's close (agentsig.deferred): acted on now
        return result

    def _restart(self: Any, wg: Any) -> None:
        self._tg_membership = wg.state == WorkerState.HEALTHY  # reap.stop_bounded: healthy workers save on the signal
        RESTARTS.append("membership" if self._tg_membership else "failure")
        events.emit("restart", remaining_restarts=self._remaining_restarts, reason=RESTARTS[-1])
        orig_restart(self, wg)
        self._tg_membership = False

    def _stop(self: Any, wg: Any, *args: Any, **kwargs: Any) -> None:
        stop_bounded(self, max(1, round(stop_timeout)), *args, **kwargs)  # reap.py: torch 2.11 too

    def _join(self: Any, timeout: float | None = None, grace_period: float | None = None) -> Any:
        # Fork/spawn: on a failure torch SIGTERMs the others and waits 30 s before SIGKILL; a worker
        # ignoring SIGTERM (save-on-signal) while its error path waits for a dead peer held the
        # restart: FAIL_GRACE, SIGTERM, FAIL_GRACE. The cause: the worker trainguard ended, if any.
        made = self.__dict__.setdefault("_tg_ready", [])  # reap.py: an ended worker seen at once
        made += expose_dead(self)
        try:
            # A stop signal in a failure's grace: after the close and its failure event. Not in torch's unbounded
            # join (timeout None: every worker returned, their processes not all ended): deferred there, a SIGTERM
            # waited for a lingering worker process (60 s seen; forever for a hung teardown).
            with agentsig.deferred(timeout is not None):
                return orig_join(self, timeout, FAIL_GRACE if grace_period is None else grace_period)
        except ProcessException as e:
            cause = root_failure(self, e)
            if cause is e:
                raise
            raise cause from e
        finally:
            self._tg_ready = close_done(self, made)

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        # A returned worker waits for this event, which torch sets only when all are done (reap.set_finished says why).
        finished = getattr(self, "_worker_finished_event", None)
        if finished is not None:
            set_finished(finished, FAIL_GRACE)  # reap.py: bounded (a waiter killed before it hung the agent)
        pids = [p.pid for p in self._pc.processes] if self._pc else []
        seen = {p.pid for p in self._pc.processes if p.is_alive()} if self._pc else set()  # torch signals these
        orig_close(self, death_sig, timeout)
        if self._pc is not None:
            reap.close_ready(self._pc)  # reap.py: the ready descriptors join left (one per failure leaked)
        reap.wait_orphans(pids, seen, death_sig, timeout)  # reap.py: a dead forkserver's children, still saving
        end_trees(pids)  # reap.py: their DataLoader processes too (a SIGKILLed worker's were left running)

    SimpleElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]
    LocalElasticAgent._monitor_workers = _monitor  # type: ignore[method-assign]
    SimpleElasticAgent._restart_workers = _restart  # type: ignore[method-assign]
    LocalElasticAgent._stop_workers = _stop  # type: ignore[method-assign]
    ProcessContext.join = _join  # type: ignore[method-assign]
    MultiprocessContext._close = _close  # type: ignore[method-assign]
    LocalElasticAgent._trainguard_hooked = True  # type: ignore[attr-defined]
