"""Events of things that went wrong, other than failures and failed saves, for ``trainguard report``.

A long run's log holds events a user must see that the report's numbers do not show: a restore that skipped
a damaged checkpoint (``restore_skip``), retention that found a kept checkpoint cut short (``retention_damaged``),
the rendezvous store gone (``store_lost``), and the rest of :data:`KINDS`. :class:`Problems` gathers them while
the log is read (``tally.Tally.add``, any rank), one entry per event name and step, whichever ranks logged it
(every rank logs ``restore_skip``; each restart skips the same checkpoint again): a few per incident, not per
line. ``report.summary`` lists them (``problems`` in ``--json``) and ``report.format_summary`` prints one line
per event name (:func:`lines`), only where there is one.
"""

from __future__ import annotations

from typing import Any

# event: (label, noun, field of the detail); keyed by step where the event has one
KINDS: dict[str, tuple[str, str, str]] = {
    "restore_skip": ("restore skipped", "checkpoints a restore found unusable", "reason"),
    "retention_damaged": ("damaged kept", "checkpoints retention found with files missing or cut short", "why"),
    "retention_unreadable": ("unreadable manifest", "kept checkpoints whose manifest did not read", "error"),
    "retention_kept": ("not deleted", "checkpoints retention could not delete", "why"),
    "retention_failed": ("retention failed", "saves whose retention failed (older checkpoints kept)", "error"),
    "ram_persist_failed": ("RAM copy failed", "steps not copied from the RAM tier to the run directory", "error"),
    "ram_remove_failed": ("RAM not removed", "RAM tier copies that could not be removed", "error"),
    "replicas_differ": ("replicas differ", "saves whose replicated tensors differed between ranks", "tensors"),
    "modified_while_staging": ("changed in save", "async saves whose tensors changed before they were copied", "tensors"),
    "store_lost": ("store lost", "times an agent found the rendezvous store gone", "error"),
    "orphaned": ("orphaned workers", "workers that found the agent gone and exited", "agent_pid"),
    "exit_barrier": ("exit barrier", "times agents left without finishing", "nodes"),
}


def _detail(e: dict[str, Any], field: str) -> str:
    """One line of what the event says went wrong (its ``field``), at most 160 characters."""
    v = e.get(field)
    if isinstance(v, list):  # tensors: names, or replicas.py's dicts with a "tensor"
        v = ", ".join(str(x.get("tensor") if isinstance(x, dict) else x) for x in v[:8]) + (", ..." if len(v) > 8 else "")
    text = "" if v is None else str(v)
    if field == "agent_pid" and text:
        text = f"agent pid {text}"
    return (text.splitlines() or [""])[0][:160]


class Problems:
    """The events of :data:`KINDS` of one log, deduplicated: fed in the log's order (:meth:`add`)."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, Any], dict[str, Any]] = {}  # (event, step or None) -> entry, in first-seen order

    def add(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        step = e.get("step")
        step = step if isinstance(step, (int, float, str)) and not isinstance(step, bool) else None
        entry = self.found.get((kind, step))
        if entry is None:
            entry = self.found[(kind, step)] = {"event": kind, "step": step, "t": e.get("t"), "count": 0, "ranks": []}
        entry["t"], entry["count"], entry["detail"] = e.get("t"), entry["count"] + 1, _detail(e, KINDS[kind][2])
        rank = e.get("rank")
        if rank not in entry["ranks"] and len(entry["ranks"]) < 1024:
            entry["ranks"].append(rank)

    def listed(self) -> list[dict[str, Any]]:
        """``report.summary``'s ``problems``: one dict per event name and step (``t`` and ``detail`` of the last
        event of it, ``count`` of events, ``ranks`` that logged it), those of one event name together."""
        order = list(KINDS)
        return sorted((dict(x) for x in self.found.values()), key=lambda x: order.index(x["event"]))


def lines(s: dict[str, Any]) -> list[str]:
    """``report.format_summary``: a line per event name of ``s["problems"]`` (none: no line): how many, their
    steps (10 at most), and the last one's detail."""
    out = []
    for kind, (label, noun, _field) in KINDS.items():
        these = [x for x in s.get("problems") or [] if x["event"] == kind]
        if not these:
            continue
        steps = [str(x["step"]) for x in these if x["step"] is not None]
        n = len(these) if steps else sum(x["count"] for x in these)
        last = max(these, key=lambda x: (x["t"] is not None, x["t"] or 0))
        where = (("step " if len(steps) == 1 else "steps ") + ", ".join(steps[:10]) + (", ..." if len(steps) > 10 else "")
                 + "; ") if steps else ""
        at = f", step {last['step']}" if last["step"] is not None and len(steps) > 1 else ""
        out.append(f"{label:<18} {n} {_one(noun) if n == 1 else noun} ({where}the last{at}: {last.get('detail') or '-'})")
    return out


_SINGULAR = {"checkpoints": "checkpoint", "saves": "save", "steps": "step", "copies": "copy", "times": "time",
             "workers": "worker"}


def _one(noun: str) -> str:
    """``lines``: ``noun`` (one of :data:`KINDS`') for a count of 1: its first plural word made singular."""
    words = noun.split(" ")
    i = next((i for i, w in enumerate(words) if w in _SINGULAR), None)
    return noun if i is None else " ".join([*words[:i], _SINGULAR[words[i]], *words[i + 1:]])
