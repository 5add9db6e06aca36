"""How the saves of a run's event log ended, for ``trainguard report``: failed, or interrupted.

Rank 0 logs ``save_start`` as each save begins (:func:`trainguard.saveevent.started`, since session 52),
then, from the same process, ``save`` when it commits or ``save_failed`` when it fails. A save whose
process ended in between has neither: a peer killed while the save was in flight, rank 0 waiting for it
and SIGKILLed by the agent 2 s later (``trainguard run``), before its own bound on the dead peer raised
(3 s): no ``save_failed``, and the report counted nothing of it. :class:`SaveEnds` (a part of
:class:`~trainguard.tally.Tally`, fed in the log's order) finds such a save: its ``save_start`` is
followed by an event that ends its process, and no ``save``/``save_failed`` of that process and step
follows it anywhere in the log:

* the agent's ``failure``, ``restart`` (the workers are stopped), ``agent_exit``, a later ``agent_start``
  (the job started again);
* rank 0's ``restore`` or ``fresh_start`` by another process (its next start; plain ``python`` too);
* rank 0's ``manager_open`` by any process, its own pid too (since review52c): a manager's ``close`` waits for its
  saves and the run lock admits one manager, so a save still open is of a process that ended, whose pid the next
  one has (``python train.py`` as pid 1 of a container, run again: its interrupted saves were never counted).

A save still in flight when the log ends (a live run) is neither. A save killed right after its commit
(before its ``save`` event) whose checkpoint a later start restored is a save (``report._restored_unlogged``),
not an interrupted one. A log written before ``save_start`` existed has no starts: its interrupted saves
are unknown (``None`` in ``report --json``), its ``save_failed`` events are counted as before they were.
"""

from __future__ import annotations

from typing import Any

ENDS_PROCESS = frozenset({"failure", "restart", "agent_exit", "agent_start"})  # the agent's
ERROR_CHARS = 500  # of a save_failed's error kept per failed save (the event holds up to 2000)


class SaveEnds:
    """Rank 0's save starts not yet ended, its failed saves, in the order fed (:meth:`Tally.add`,
    :meth:`Tally.save`)."""

    def __init__(self) -> None:
        self.starts = 0  # save_start events seen (0: a log from before they were written)
        self.open: dict[tuple[Any, Any], list[Any]] = {}  # (pid, step) -> [t, its process ended since]
        self.failed: list[tuple[Any, Any, str]] = []  # (t, step, error) of rank 0's save_failed events

    @staticmethod
    def _key(pid: Any, step: Any) -> tuple[Any, Any] | None:
        key = (pid, step)
        try:
            hash(key)
        except TypeError:  # a garbled line (a list for a step): not a save of any process
            return None
        return key

    def start(self, t: Any, pid: Any, step: Any) -> None:
        """Rank 0's ``save_start``."""
        self.starts += 1
        if (key := self._key(pid, step)) is not None:
            self.open[key] = [t, False]

    def ended(self, pid: Any, step: Any) -> None:
        """Rank 0's ``save`` (committed) of ``step`` by process ``pid``."""
        if self.open and (key := self._key(pid, step)) is not None:
            self.open.pop(key, None)

    def failed_save(self, t: Any, pid: Any, step: Any, error: Any) -> None:
        """Rank 0's ``save_failed``."""
        self.ended(pid, step)
        self.failed.append((t, step, str(error or "")[:ERROR_CHARS]))

    def process_ended(self, survivor: Any = None) -> None:
        """An event that ends the processes that began the open saves (the module docstring), all but
        ``survivor`` (the pid of rank 0's restore or fresh start: the process that logs it lives on)."""
        for (pid, _step), v in self.open.items():
            if pid != survivor:
                v[1] = True

    def interrupted(self) -> list[tuple[Any, Any]]:
        """``(t, step)`` of the saves begun and never ended whose process ended, in the order begun."""
        return [(v[0], step) for (_pid, step), v in self.open.items() if v[1]]
