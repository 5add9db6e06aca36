"""Named fault points in the save path, for crash drills and tests.

``TRAINGUARD_CRASH_AT=<point>`` makes the process fail when it reaches ``point``;
``TRAINGUARD_CRASH_RANK`` limits it to one rank; ``TRAINGUARD_CRASH_KIND`` is ``exit``
(``os._exit(17)``, the default: no cleanup runs, like a power cut for this process), ``kill``
(SIGKILL to itself), ``stop`` (SIGSTOP to itself: a hung rank, until something sends it
SIGCONT) or ``raise`` (a ``RuntimeError``, as from a failing disk);
``TRAINGUARD_CRASH_SKIP=n`` lets the point pass ``n`` times first.

Points, in order: ``begin`` (after the ranks agreed to save), ``write_begin`` (data file
opened), ``write_piece`` (after each written piece), ``before_fsync``, ``written`` (data
durable, before reporting), ``before_manifest`` (rank 0, all ranks reported),
``after_manifest`` (manifest durable in the temp dir), ``after_rename`` (committed),
``before_retention``. With ``ram_tier=``, also ``before_persist`` (rank 0's background copy of a
step committed in RAM to the run directory, its temp directory made; not in ``POINTS``: a save
without the RAM tier never passes it), after which ``before_retention`` follows that copy.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "begin",
    "write_begin",
    "write_piece",
    "before_fsync",
    "written",
    "before_manifest",
    "after_manifest",
    "after_rename",
    "before_retention",
)

_passed: dict[str, int] = {}


def fault(point: str, rank: int = 0) -> None:
    """Called at each named point; does nothing unless the environment asks for a crash here."""
    if os.environ.get("TRAINGUARD_CRASH_AT") != point:
        return
    want_rank = os.environ.get("TRAINGUARD_CRASH_RANK")
    if want_rank not in (None, "") and int(want_rank) != rank:
        return
    _passed[point] = _passed.get(point, 0) + 1
    if _passed[point] <= int(os.environ.get("TRAINGUARD_CRASH_SKIP", "0")):
        return
    kind = os.environ.get("TRAINGUARD_CRASH_KIND", "exit")
    if kind == "raise":
        raise RuntimeError(f"injected failure at {point} on rank {rank}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":  # sent to this thread: it stops here, not some instructions later
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return
    os._exit(17)
