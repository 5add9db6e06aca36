"""A stop signal the agent's main thread cannot take up still ends ``trainguard run``'s agent, within seconds.

A Python signal handler runs only when the main thread comes back to the interpreter. The agent's main thread
spends long stretches inside C++ calls that release the GIL and do not return on a signal: the ``TCPStore``
connect of its first rendezvous (an endpoint that accepts but does not answer: the store's 60 s timeout),
torch's exit barrier (a store wait of up to 300 s for the other agents), a store call on a frozen store. A
SIGTERM there waited for the call (80 s and more seen; over 4 minutes in the exit barrier).

:func:`start` (``launcher.main``, once, main thread, before torch's agent runs) points ``signal.set_wakeup_fd``
at a pipe: Python's C-level handler writes each signal's number there at once, whatever the main thread does.
A daemon thread reads it. For a stop signal it waits :data:`STUCK_AFTER` s for the agent's handler to run
(:func:`.agentsig.install_signal_once`'s, which calls :func:`take` first); when it has not, the thread claims
the exit and calls the launcher's ``on_stuck``, :func:`exit_stuck` (it stops running workers with the signal,
logs ``agent_exit``, removes the temp log directory, and ends the process with ``os._exit(128 + N)``). Whoever
claims first owns the exit: a handler that runs after the thread claimed parks the main thread until the process
ends (it must not act on the signal a second time, nor let the agent restart workers the thread is stopping).

A worker forked from the agent (``--start-method fork``) would inherit the wakeup fd and write its own signals
into the agent's pipe: an at-fork hook turns it off in the child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

STUCK_AFTER = 2.0  # s: a main thread in Python runs its handler within milliseconds (time.sleep is interrupted)

_lock = threading.Lock()
_owner: list[str] = []  # "main" or "watcher": who acts on the stop signal (first claim wins)
_taken = threading.Event()  # set once the main thread's handler ran
_fds: list[int] = []


def take() -> bool:
    """The agent's stop-signal handler, in the main thread, before it acts on the signal: True when the main
    thread owns the stop (or already did); False when the watcher thread took it over (the handler then parks)."""
    with _lock:
        if not _owner:
            _owner.append("main")
        _taken.set()
        return _owner[0] == "main"


def park() -> None:
    """Main thread, in the handler, after :func:`take` returned False: wait for the watcher's ``os._exit``
    (bounded: it exits within the workers' shutdown timeout; this returns after an hour at most)."""
    threading.Event().wait(3600)


def _claim() -> bool:
    with _lock:
        if _owner:
            return False
        _owner.append("watcher")
        return True


def where_main_waits() -> str:
    """``file:line (function)`` of the main thread's innermost Python frame: where it entered the C call."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    last = traceback.extract_stack(frame)[-1]
    return f"{last.filename}:{last.lineno} ({last.name})"


def _watch(rfd: int, stops: frozenset[int], on_stuck: Callable[[int], None], grace: float) -> None:
    while True:
        try:
            data = os.read(rfd, 64)
        except OSError:
            return
        if not data:
            return
        signum = next((b for b in data if b in stops), None)
        if signum is None or _taken.is_set():
            continue
        if _taken.wait(grace) or not _claim():
            continue
        on_stuck(signum)  # ends the process
        return


def _in_child() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for fd in _fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _fds.clear()


def exit_stuck(events: Any, signum: int, agent: Any) -> None:
    """The watcher thread (the launcher's ``on_stuck``), when the agent's handler did not take up stop signal
    ``signum`` within its grace: the main thread is inside a C++ call (a store connect or wait: the rendezvous, the
    exit barrier). Do what ``launcher.main`` does on the signal, from this thread: torch's ``agent``'s workers, if
    any run, get the signal and torch's shutdown timeout (its ``_pcontext.close``); then ``agent_exit`` (with
    ``waiting_in``: where the main thread waits), the stop note and the temp log directory removed, and the process
    ends with 128 + the signal (``os._exit``: the main thread never returns from its call; no finalization, so no
    keep-alive heartbeat can abort it)."""
    from . import errfiles
    from .stops import STOP_FILE_ENV, clear

    sig, where = signal.Signals(signum), where_main_waits()
    pc = getattr(agent, "_pcontext", None)
    try:
        if pc is not None:
            pc.close(sig, int(getattr(agent, "_shutdown_timeout", 30) or 30))
        events.emit("agent_exit", ok=False, signal=sig.name, waiting_in=where)
        print(f"trainguard run: stopped by {sig.name} while the agent waited in a call that does not return on a "
              f"signal ({where}); see {events.path}", file=sys.stderr, flush=True)
        clear(os.environ.get(STOP_FILE_ENV))
        errfiles.remove_log_dir()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(128 + signum)


def start(stops: list[signal.Signals], on_stuck: Callable[[int], None], grace: float = STUCK_AFTER) -> bool:
    """Agent, main thread, once (``launcher.main``): watch for ``stops`` whose handler does not run within ``grace``
    s and call ``on_stuck(signum)`` then, from a daemon thread. False when a wakeup fd was set already (another
    user of it in this process: left alone, nothing watched)."""
    if _fds:
        return True
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    if old != -1:
        signal.set_wakeup_fd(old)
        os.close(rfd)
        os.close(wfd)
        return False
    _fds.extend((rfd, wfd))
    os.register_at_fork(after_in_child=_in_child)
    threading.Thread(target=_watch, args=(rfd, frozenset(int(s) for s in stops), on_stuck, grace),
                     name="trainguard-signal-watch", daemon=True).start()
    return True
