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
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from . import sigwatch

AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torch's agent turns into SignalException
TORCH_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torch's PContext.start: the signals it handles (default these)


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


def handled_names(args: Any) -> list[str]:
    """Agent (:func:`.launcher.main`), main thread, before torch's agent runs: the signals its handler is to take
    (torch's ``--signals-to-handle``, default SIGTERM, SIGINT, SIGHUP, SIGQUIT; an older torch: the variable
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``) less those this process ignores (``nohup``: SIGHUP), which are taken out of
    ``args`` and of that variable: torch's ``PContext.start`` installs its handler on each one listed when it
    starts the workers, and ``nohup trainguard run ... &`` then a logout (the shell's SIGHUP to its jobs) stopped
    the job (exit 129). Left ignored, the workers inherit them ignored too. When every one given is ignored
    (``nohup ... --signals-to-handle SIGHUP``) torch gets an empty list (before: the whole list, SIGHUP handled, the
    logout's 129; review55h), and its warning for the empty name (a traceback) is left out."""
    given = getattr(args, "signals_to_handle", None) or os.environ.get(TORCH_SIGNALS_ENV) or ",".join(AGENT_SIGNALS)
    names = [n.strip() for n in str(given).split(",") if n.strip()]
    ignored = [n for n in names if isinstance(getattr(signal, n, None), signal.Signals)
               and signal.getsignal(getattr(signal, n)) is signal.SIG_IGN]
    kept = [n for n in names if n not in ignored]
    if ignored:
        if getattr(args, "signals_to_handle", None):
            args.signals_to_handle = ",".join(kept)
        os.environ[TORCH_SIGNALS_ENV] = ",".join(kept)  # what torch's launch_agent sets from args (2.13)
        if not kept:  # torch's PContext.start: "".split(",") is [""], which it warns about with a traceback
            logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_no_empty_name)
        return kept
    return names


def _no_empty_name(record: logging.LogRecord) -> bool:
    return not (str(record.msg).startswith("Failed to register signal handler") and record.args == ("",))


def named(names: list[str]) -> list[signal.Signals]:
    """Agent (:func:`.launcher.main`), main thread, before torch's agent runs: the signals of ``names``
    (:func:`handled_names`) that torch's handler will take (``PContext.start``), those this process ignores left
    out; not only :data:`AGENT_SIGNALS`: torch's ``--signals-to-handle`` suggests SIGUSR1 and SIGUSR2 for Slurm.
    :func:`after_result` covers them all."""
    sigs = [getattr(signal, n.strip(), None) for n in names]
    return [s for s in dict.fromkeys(sigs) if isinstance(s, signal.Signals) and signal.getsignal(s) is not signal.SIG_IGN]


def torch_handled() -> list[signal.Signals]:
    """The signals whose handler is now torch's (``api._terminate_process_handler``, as :func:`install_signal_once`
    wrapped it): those of ``--signals-to-handle`` once torch's agent started workers."""
    from torch.distributed.elastic.multiprocessing import api

    return [s for s in signal.valid_signals() if isinstance(s, signal.Signals)
            and signal.getsignal(s) is api._terminate_process_handler]


def install_early(names: list[str] | None = None) -> list[signal.Signals]:
    """Agent (:func:`.launcher.main`), main thread, before torch's agent runs: the agent's handler (torch's
    ``_terminate_process_handler``, as :func:`install_signal_once` wrapped it) for those of :data:`AGENT_SIGNALS`
    in ``names`` (:func:`handled_names`; default all of them) now. torch installs it only when it starts the first
    workers: a SIGTERM during the first rendezvous (agents waiting for their peers, a job cancelled then) killed
    the agent by the signal's default action (no ``agent_exit``, its ``trainguard-logs-*`` directory left), a
    SIGINT ended it with a ``KeyboardInterrupt`` traceback. A signal this process ignores stays ignored. Returns the
    signals handled; :mod:`.sigwatch` covers a main thread that cannot run the handler (inside a C++ call)."""
    from torch.distributed.elastic.multiprocessing import api

    names = list(AGENT_SIGNALS) if names is None else names
    sigs = [getattr(signal, n) for n in AGENT_SIGNALS if n in names and hasattr(signal, n)]
    handled = [s for s in sigs if signal.getsignal(s) is not signal.SIG_IGN]
    for s in handled:
        signal.signal(s, api._terminate_process_handler)
    return handled


def after_result(code: int, sigs: list[signal.Signals]) -> None:
    """Agent (:func:`.launcher.main`), main thread, once its exit code ``code`` is known (torch's agent returned
    or raised, the event logged): a stop signal from then on, until the process ends, is only reported and the
    exit code stays ``code``; a second one of the same kind ends the process by its default action. Before, the
    handler of the run stayed installed on a finished job: a SIGTERM in the ~2 s of the interpreter's exit (its
    atexit calls) raised ``SignalException`` there, a traceback, the temp log directory's removal cut short (the
    directory left), or the agent died of the signal (-15) once Python had put the defaults back; after a stop
    signal the defaults were put back at once, and a repeated ``scancel`` killed the agent the same way. The watcher
    thread of :mod:`.sigwatch` stands down first (:func:`.sigwatch.take`: the main thread owns every stop from now
    on): it ended the agent with 128 + the signal, and logged a second ``agent_exit``, when the signal came while
    the main thread was inside a call that does not return on a signal for over 2 s of the exit (a finished or
    failed job: 143 instead of 0 or 1, a requeue of a failed job; review55h). Such a signal is now handled when
    that call returns."""
    sigwatch.take()
    seen: list[int] = []

    def late(signum: int, frame: Any) -> None:
        sigwatch.take()  # the main thread runs: the watcher thread does not end the process
        if signum in seen:
            signal.signal(signum, signal.SIG_DFL)
            return signal.raise_signal(signum)
        seen.append(signum)
        print(f"trainguard run: {signal.Signals(signum).name} after the job's end; exiting with {code} "
              "(again: by the signal)", file=sys.stderr, flush=True)

    for s in sigs:
        signal.signal(s, late)
    _LATE[:] = sigs


_LATE: list[signal.Signals] = []  # the signals after_result handles


def ignore_late() -> None:
    """Agent, the last of its atexit calls (registered by :func:`.launcher.main` before the others): the
    signals :func:`after_result` handles are ignored for what is left of the exit (the interpreter puts a
    Python handler's signal back to its default action, and torch's C++ teardown follows: a SIGTERM then
    killed the agent, -15, in 1 of 3 tries 0.3 s after a finished job's ``agent_exit``)."""
    for s in _LATE:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(s, signal.SIG_IGN)
