"""The JSONL event log: one JSON object per line under ``<run dir>/events.jsonl``.

Written by the manager (saves, restores, failures) and by ``trainguard run`` (starts,
rendezvous, restarts). Each line carries ``t`` (unix time), ``event``, and the writer's
``rank`` and ``pid``. Appends are single ``write`` calls of whole lines with O_APPEND, so
several processes may log to the same file without interleaving lines.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
log = logging.getLogger("trainguard")


class EventLog:
    """Appends events to a JSONL file; a no-op when ``path`` is None.

    The log is a record, not part of a checkpoint: a line that cannot be written (a full disk,
    a read-only or removed directory) is dropped with one warning per log, and the caller (a
    save that succeeded, a restore) goes on. The log creates its directory for its first line (the
    elastic agent's log, before any worker opened the run directory), not after: a run directory
    removed while the job runs (``rm -rf``) was created again, empty, by the next event."""

    def __init__(self, path: str | os.PathLike[str] | None, *, rank: int = 0) -> None:
        self.path = None if path is None else Path(path)
        self._wrote = False  # a line was written: the directory is not created again
        self.rank = rank
        self._warned = False

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"t": time.time(), "event": event, "rank": self.rank, "pid": os.getpid(), **fields}
        if self.path is not None:
            line = (json.dumps(rec, default=str) + "\n").encode()
            try:
                if not self._wrote:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line)
                    self._wrote = True
                finally:
                    os.close(fd)
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    log.warning("trainguard: cannot write the event log %s (%s); events are dropped until it can", self.path, e)
        return rec


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a JSONL log (``trainguard report``, tests). A line that is no event
    of :class:`EventLog` is skipped: a torn last line (a crash mid-write), undecodable bytes, or
    a line of another tool's log; NUL bytes before a line (a file system that zero-fills a tail
    lost in a power loss: the next line is written after them) are dropped (not an object with a string ``event``, a
    finite ``t``, and the fields its kind has: ``_well_formed``)."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.exists():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip().lstrip("\0")  # NULs: the zero-filled tail a power loss may leave before it
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict) and isinstance(ev.get("event"), str) and _well_formed(ev):
                yield ev


# Fields ``report.summarize`` computes with: ints each event of that kind has (else it is no
# event of EventLog's: skipped, where it raised KeyError), and numbers some have.
_INTS = {"step": ("step",), "fault": ("step",), "restore": ("step",), "save": ("step",)}  # save: plot_timeline
_NUMBERS = ("t", "seconds", "stall_s", "duration_s", "lost_steps", "bytes", "committed_t")


def _well_formed(ev: dict[str, Any]) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    return ("t" in ev and all(number(ev[k]) for k in _NUMBERS if k in ev and ev[k] is not None)
            and all(type(ev.get(k)) is int for k in _INTS.get(ev["event"], ())))
