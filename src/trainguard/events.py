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

    def __init__(self, path: str | os.PathLike[str] | None, *, rank: int = 0, mono: bool = False) -> None:
        self.path = None if path is None else Path(path)
        self._wrote = False  # a line was written: the directory is not created again
        self.rank = rank
        self.mono = mono  # each event also carries time.monotonic() (the agent's: clockback.py)
        self._warned = False

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"t": time.time(), "event": event, "rank": self.rank, "pid": os.getpid(), **fields}
        if self.mono:
            rec["mono"] = round(time.monotonic(), 6)
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
    finite ``t``, and the fields its kind has: ``_well_formed``). An event written after a torn
    line (a short write: a full disk, a file size limit, a process killed inside a long write) is
    read: it begins where that line's text stops (:func:`parse_line`), it was dropped with it.
    The log is read as it was at the call (its size then): lines a live run appends meanwhile are not."""
    for raw in log_lines(path):
        for line in text_lines(raw):
            yield from parse_line(line)


def log_lines(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """The raw lines (bytes, ``\\n`` kept) of the log at ``path`` (a file, or a run directory holding
    ``events.jsonl``), up to its size when it was opened (a live run appends meanwhile: the reader
    ends; the line it was writing then is read whole if it is there by then)."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        return
    with f:
        size, pos = os.fstat(f.fileno()).st_size, 0
        for raw in f:
            yield raw
            pos += len(raw)
            if pos >= size:
                return


def text_lines(raw: bytes) -> list[str]:
    """One raw line as a text-mode reader (``open(encoding="utf-8", errors="replace")``, what
    ``read_events`` read with) splits it: undecodable bytes replaced, a lone ``\\r`` ends a line too."""
    text = raw.decode("utf-8", "replace")
    return [text] if "\r" not in text else text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


_START = '{"t": '  # how each line of EventLog begins (json.dumps of a dict whose first key is t)
_DECODER = json.JSONDecoder()


def parse_line(line: str) -> list[dict[str, Any]]:
    """The events of one line of the log: one, or none (no event of EventLog's: ``read_events``).

    A line that does not parse may be a torn line's text with a whole event after it: a short write
    leaves no newline, so the next line written (by any process, after a restart) goes on after it.
    Each event is then read where a ``{"t": `` begins from which an object parses (a string in the
    log cannot hold ``{"t": ``: json.dumps writes its quotes as ``\\"``), the torn text skipped."""
    line = line.strip().lstrip("\0")  # NULs: the zero-filled tail a power loss may leave before it
    if not line:
        return []
    try:
        ev = json.loads(line)
    except json.JSONDecodeError:
        return _glued(line)
    return [ev] if _is_event(ev) else []


def _glued(line: str) -> list[dict[str, Any]]:
    """``parse_line``: the events of a line that is no JSON, each one where it begins."""
    found, i = [], 0
    while 0 <= i < len(line):
        try:
            ev, end = _DECODER.raw_decode(line, i)
        except json.JSONDecodeError:
            i = line.find(_START, i + 1)
            continue
        if _is_event(ev):
            found.append(ev)
        i = line.find(_START, end)
    return found


def _is_event(ev: Any) -> bool:
    return isinstance(ev, dict) and isinstance(ev.get("event"), str) and _well_formed(ev)


def event_at(buf: Any, pos: int) -> tuple[int, int, dict[str, Any] | None]:
    """The line of ``buf`` (the log's bytes) holding byte ``pos``: its start, its end, and the event at
    ``pos`` (None: torn or not an object): the line's, or, when the line is a torn line's text with an
    event after it (:func:`parse_line`), the event that begins last before ``pos``. Called by the
    watchdog's count of lost steps (``elastic.watchdog._lost_steps``), which reads no line but these."""
    a = buf.rfind(b"\n", 0, pos) + 1
    b = buf.find(b"\n", pos)
    b = len(buf) if b < 0 else b
    try:
        ev = json.loads(buf[a:b].lstrip(b"\0"))  # NULs: a power loss's zero-filled tail before it
    except ValueError:
        start = buf.rfind(_START.encode(), a, pos + 1)
        try:
            ev = _DECODER.raw_decode(buf[start:b].decode("utf-8", "replace"))[0] if start >= 0 else None
        except ValueError:
            ev = None
    return a, b, ev if isinstance(ev, dict) else None


# Fields ``report.summarize`` computes with: ints each event of that kind has (else it is no
# event of EventLog's: skipped, where it raised KeyError), and numbers some have.
_INTS = {"step": ("step",), "fault": ("step",), "restore": ("step",), "save": ("step",)}  # save: plot_timeline
_MAX = 1 << 1023  # ints from 2 ** 1024 - 2 ** 970 on are past a float's range
_NUMBERS = ("t", "seconds", "stall_s", "duration_s", "lost_steps", "bytes", "committed_t", "stop_s", "mono")


def _well_formed(ev: dict[str, Any]) -> bool:
    def number(v: Any) -> bool:  # an int a float cannot hold (a garbled line) is none: isfinite raised OverflowError
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, float) or -_MAX < v < _MAX)
                and math.isfinite(v))

    return ("t" in ev and all(number(ev[k]) for k in _NUMBERS if k in ev and ev[k] is not None)
            and all(type(ev.get(k)) is int for k in _INTS.get(ev["event"], ())))
