"""The ``stacklevel`` that makes a library warning name the user's line.

``warnings.warn`` calls of trainguard that count a fixed ``stacklevel`` name a frame of the library
whenever a wrapper sits between: the manager's one-thread guard (:mod:`trainguard.onethread`) and the
operation wrapper of ``tg.save``/``tg.load`` (:func:`trainguard.dist.one_operation`) each add one. A
run resumed after a SIGKILL warned ``.../trainguard/onethread.py:57: UserWarning: taking over a stale
lock ...`` and, at another world size, ``.../trainguard/dist.py:149: UserWarning: rng: saved by 2
ranks, loading on 1 ...``, with a line of the library under it instead of the script's
``with tg.CheckpointManager(...)`` or ``mgr.restore(state)``. Called by :mod:`trainguard.runlock`
and :mod:`trainguard.rankload` as ``warnings.warn(message, stacklevel=user_stacklevel())``.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THREADING = os.path.abspath(threading.__file__)  # a thread's bootstrap frames (Thread.run, _bootstrap_inner)


def user_stacklevel() -> int:
    """For a ``warnings.warn`` call in trainguard: the ``stacklevel`` of the nearest caller outside the
    package (1, the calling function itself, when every frame up is trainguard's or a thread's bootstrap
    in ``threading``: a thread whose target is trainguard's, such as ``Thread(target=mgr.open)``; that
    warning named ``threading.py:982``, a line no user wrote)."""
    frame: FrameType | None = sys._getframe(1)  # the function that calls warnings.warn is level 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    if frame is None or os.path.abspath(frame.f_code.co_filename) == _THREADING:
        return 1
    return level


def warn_each(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning whose text names a step (a failed save, a retention that failed, a save mid-accumulation), at the
    nearest caller outside the package, shown each time and remembered nowhere. ``warnings.warn`` keeps an entry
    per distinct text in the warning location's ``__warningregistry__`` for the life of the process: one per such
    save, never looked up again, up to 2,000 characters each (review58c: 300 failing saves of ``on_error="warn"``,
    305 entries held). Called by ``CheckpointManager._report_failure``, ``retention.apply_retention`` and
    ``gradwatch.check``; the filters (``-W error``, ``catch_warnings``) apply as to ``warnings.warn``."""
    here = frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename) == _THREADING:
        frame = here  # a thread of trainguard's (the async save's): the calling function's line
    g = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module=g.get("__name__"),
                           registry=None, module_globals=g)  # registry None: a fresh dict, dropped after the call
