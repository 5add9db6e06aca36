"""Reading a long event log fast: ``step`` and ``save`` lines without ``json`` (``trainguard report``).

Those two kinds are nearly every line of a long run's log (a ``step`` a training step, a ``save`` per
rank per checkpoint). A line in exactly the form :class:`~trainguard.events.EventLog` writes them
(``json.dumps`` of the fields their callers pass, in that order) is read with a regular expression
that matches nothing else: plain ASCII, each value a JSON number of the kind ``json`` reads as the
same ``int`` or finite ``float`` (``float()``, ``int()`` of the same digits), so it yields the event
that ``events.read_events`` yields for it. Any other line, a field more, another order, takes
that path (:func:`~trainguard.events.parse_line`). Called by ``report.tally_log`` only.
"""

from __future__ import annotations

import os
import re

from .events import log_lines, parse_line, text_lines
from .tally import Tally

_T = rb"(-?(?:0|[1-9][0-9]{0,15})\.[0-9]{1,17})"  # time.time(): a float with a dot, finite
_I = rb"(-?(?:0|[1-9][0-9]{0,17}))"  # an int (no leading zero: JSON)
_N = rb"(-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,17})?(?:e-[0-9]{1,2})?)"  # round(x, 6): 0.0, 1e-06, 3, finite
_STEP = re.compile(rb'\{"t": ' + _T + rb', "event": "step", "rank": ' + _I + rb', "pid": ' + _I + rb', "step": ' + _I
                   + rb', "world_size": -?(?:0|[1-9][0-9]{0,17})(?:, "mono": ' + _T + rb')?\}\n?')
_SAVE = re.compile(
    rb'\{"t": ' + _T + rb', "event": "save", "rank": ' + _I + rb', "pid": ' + _I + rb', "step": ' + _I
    + rb', "stall_s": ' + _N + rb', "duration_s": ' + _N + rb', "stall_call_s": ' + _N + rb', "stall_hook_s": ' + _N
    + rb', "stall_wait_s": ' + _N + rb', "stall_prev_s": ' + _N + rb', "bytes": ' + _I
    + rb', "async_save": (?:true|false), "committed_t": ' + _N + rb'\}\n?')


def _num(b: bytes) -> int | float:
    """A number of ``_N`` as ``json`` reads it: a float with a dot or an exponent, else an int."""
    return float(b) if b"." in b or b"e" in b else int(b)


def feed(path: str | os.PathLike[str], tally: Tally) -> Tally:
    """Every event of the log at ``path`` (a file or a run directory) into ``tally``, in the log's order."""
    step_m, save_m, seen, step = _STEP.fullmatch, _SAVE.fullmatch, tally._seen, tally.step_line
    for raw in log_lines(path):
        m = step_m(raw)
        if m is not None:
            step(float(m[1]), int(m[3]), int(m[4]), None if m[5] is None else float(m[5]))
            continue
        m = save_m(raw)
        if m is not None:
            t = float(m[1])
            seq = seen(t)
            if int(m[2]) == 0:
                tally.save(t, seq, _num(m[5]), _num(m[6]), int(m[11]), _num(m[12]), int(m[4]), int(m[3]))
            continue
        for line in text_lines(raw):
            for ev in parse_line(line):
                tally.add(ev)
    return tally

