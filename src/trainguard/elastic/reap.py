"""A dead worker whose children live on is still seen dead at once (``trainguard run``'s agent).

torch's agent (function entrypoints: ``--run-path``) learns that a worker ended from its process
*sentinel*, a pipe whose write end the worker holds. A worker's DataLoader processes (forked from
it) hold that end too, so a worker SIGKILLed or OOM-killed was seen dead only when its loader
workers ended: torch's loader watchdog notices a dead parent within 5 s (5.1-5.2 s measured by
the chaos review, 3 of 4 kills; 0.03-0.08 s without loader workers). The agent polls its workers
every ``--monitor-interval`` through ``ProcessContext.join``; before each, :func:`expose_dead`
asks each worker's exit status (``waitpid(WNOHANG)``, as ``Process.exitcode`` does) and gives a
worker that has ended a sentinel that is ready, so torch's ``join`` handles it at once.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any


def expose_dead(pc: Any) -> list[int]:
    """Agent, in its ``ProcessContext.join`` hook, before torch's ``join``: the ended workers of
    ``pc`` whose sentinel is still open get a ready one instead. Returns the descriptors made here,
    for :func:`close_done` after the ``join``."""
    made = []
    for sentinel, index in list(pc.sentinels.items()):
        if pc.processes[index].exitcode is None:  # alive (poll: waitpid WNOHANG)
            continue
        r, w = os.pipe()
        os.close(w)  # read end at EOF: ready for multiprocessing.connection.wait
        del pc.sentinels[sentinel]
        pc.sentinels[r] = index
        made.append(r)
    return made


def close_done(pc: Any, made: list[int]) -> list[int]:
    """Agent, after torch's ``join``: close the descriptors of :func:`expose_dead` that ``join``
    took out of ``pc.sentinels`` (it handled their workers); returns those it still holds."""
    left = []
    for fd in made:
        if fd in pc.sentinels:
            left.append(fd)
        else:
            with contextlib.suppress(OSError):
                os.close(fd)
    return left
