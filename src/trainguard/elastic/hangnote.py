"""Which hung worker waited for another: the note a worker's hang watchdog leaves for its agent.

When one rank hangs (a deadlock, a stuck read), its peers block in their next collective and
stop beating too: every rank's watchdog declares a hang within milliseconds of the others (they
all last beat at the same step), every worker exits 75, and the agent named the lowest rank
(:func:`.stops.first_failure`, :func:`.stops.root_failure`): ``--fault step=6,rank=1,kind=hang``
was logged and reported as "rank 0 hang (watchdog)", sending the user to the stacks of a rank
that was only waiting in ``all_reduce``.

The watchdog (:meth:`.watchdog.Watchdog._on_hang`, in the worker) calls :func:`record` before it
exits: the ``torch.distributed`` call its main thread is blocked in, if any (a frame of
``distributed_c10d.py``: ``all_reduce``, ``barrier``, ``broadcast``, ...), logged in the ``hang``
event as ``waiting_in`` and written to ``<stop file>.hang-<pid>`` for the agent. The agent
(:func:`.stops.first_failure`, :func:`.stops.root_failure`) then names another failed worker: one
that hung on its own, or, when the agent looked before that one's watchdog fired, the one it
stopped (its cause then reads as the agent's SIGTERM). Without notes, or when every failed worker
waited, as before. DDP's all-reduce waits inside ``backward()``, in C++: such a wait is not told
apart here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

HANG_EXIT = 75  # watchdog.HANG_EXIT (the watchdog imports this module)

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def collective_call() -> str | None:
    """The ``torch.distributed`` function (of ``distributed_c10d.py``) the main thread is inside, or None."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def _note(pid: int) -> str | None:
    path = os.environ.get("TRAINGUARD_STOP_FILE")  # stops.STOP_FILE_ENV (stops imports the watchdog)
    return f"{path}.hang-{pid}" if path else None


def record() -> str | None:
    """The hung worker, as its watchdog ends it: what :func:`collective_call` says, noted for the agent."""
    call = collective_call()
    with contextlib.suppress(OSError):
        if (path := _note(os.getpid())) is not None:
            with open(path, "w") as f:
                f.write(call or "")
    return call


def take(path: str | None) -> str | None:
    """Agent: the text of a worker's note file at ``path`` (stripped), the file removed; None without one.
    The hang notes here and ``stops.raised_at``'s notes of an exception are read so."""
    try:
        with open(path or "") as f:
            text = f.read().strip()
        os.remove(path or "")
    except OSError:
        return None
    return text


def waited(pid: int) -> bool:
    """Agent: whether hung worker ``pid`` was blocked in a collective (its note says so); the note is removed."""
    return bool(take(_note(pid)))


def waiting(workers: dict[int, Any]) -> set[int]:
    """Agent: the keys of ``workers`` (ranks or process indices to objects with ``pid`` and ``exitcode``)
    whose worker exited as hung (75) while blocked in a collective, by their notes (each read and removed)."""
    return {k for k, w in workers.items() if w.exitcode == HANG_EXIT and waited(getattr(w, "pid", -1))}
