"""The end of a ``CheckpointManager``'s run: ``close``/``__exit__``, ``wait`` and how a failed save is reported.

Moved out of ``manager.py``: ``CheckpointManager`` (manager.py) inherits these methods from ``_ManagerClose``
and nobody else uses the class; ``manager.py``'s class decorators (``one_thread_at_a_time``,
``watchdog.untimed``) wrap ``close`` and ``wait`` on ``CheckpointManager`` as before. Every rank, last:
``close()`` (or the ``with`` block's exit) waits for the save in flight (``wait`` -> ``_finish_pending``,
which stays in manager.py), runs the closing round and releases the lock, the staging memory and the signal
handlers; ``_report_failure`` (also from ``save``/``_save_now``) raises or warns per ``on_error``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from . import policies, runlock
from .async_save import release_staging
from .distwait import closing_round, drop_channel
from .elastic import stops, watchdog
from .errors import CheckpointError
from .iostall import StuckWriteError
from .permanent import flag, is_permanent
from .userframe import warn_each

log = logging.getLogger("trainguard")


class _ManagerClose:
    """Closing, waiting and failure reports of :class:`~trainguard.manager.CheckpointManager` (its only subclass)."""

    def __exit__(self, *exc: Any) -> None:
        clean = isinstance(exc[1], SystemExit) and exc[1].code in (0, None)  # sys.exit(0) in the block: a clean end
        if exc[0] is None or clean:
            return self.close()
        try:  # the block's own exception goes on: a failed last save is logged, not raised over it
            self._failing = True  # no closing round: the others may wait for this rank elsewhere
            self.close(keep_ram_tier=True)
        except CheckpointError as e:
            log.error("trainguard: while handling %s: %s", exc[0].__name__, e)

    def close(self, *, keep_ram_tier: bool = False) -> None:
        """Every rank, last: wait for the save in flight (its error is raised here, or warned with ``on_error="warn"``), release the lock, the async staging memory and the manager's channel (``distwait.drop_channel``). The RAM tier is removed unless ``keep_ram_tier``, an exception or a preemption signal (any rank's)."""
        flag("keep_ram_tier", keep_ram_tier)
        drop_channel(self.ctx)  # from the process's channels (one per trial of a sweep stayed): self.ctx goes on
        failing = self.__dict__.pop("_failing", False)  # __exit__ with an exception: no closing round
        if not self._opened:
            return
        watchdog.suspend()  # training is over: what follows (the last save, evaluation) is no hang
        try:
            self.wait()
            stops.note_stop(self)  # a stop signal while it waited for the last save too: the run was stopped
            if self.ram:
                self.ram.close(clean=not (keep_ram_tier or self._preempt.is_set() or self.should_stop))  # any rank's signal
            if not failing:
                closing_round(self.ctx, self.timeout)  # rank 0 (the store's host) leaves last
        finally:
            if self.async_save:
                release_staging(self)  # after a failed last save too: its pool was released
            if threading.current_thread() is threading.main_thread():  # Python refuses elsewhere: they stay set
                policies.unchain_handlers(self._on_signal, self._old_handlers)  # another open manager's chain too
            if self._lock:
                self._lock.release()
            self._opened = False

    @property
    def exit_code(self) -> int:
        """After ``close()``: 0, or 128 + the stop signal that stopped the run (any rank's: 143), for ``sys.exit`` (docs/elastic.md)."""
        return 0 if self.stopped_by is None else 128 + self.stopped_by

    def _on_signal(self, signum: int, frame: Any) -> None:
        policies.on_stop_signal(self, signum, frame)  # only sets a flag (and tells a manager opened before this one)

    def _report_failure(self, e: CheckpointError, step: int | None) -> None:
        self.events.emit("save_failed", step=step, error=str(e)[:2000])
        self._metrics.pop(step, None)  # not committed: a step on disk has its manifest's (retention._facts), none stays
        if self.ram:  # a save into RAM that found no room there: the next ones go to the run directory
            self.ram.no_room(step, e)
        # Raised whatever on_error: a stuck write; the run lock lost (another job may write there); a permanent error
        # failing a second save in a row (a value no save can store; a metric refused once is passed anew). Every rank's alike.
        again, self._failed_permanent = self._failed_permanent, is_permanent(e)
        if self.on_error == "raise" or isinstance(e, StuckWriteError) or (is_permanent(e) and (again or runlock.LOST in str(e))):
            raise e
        log.warning("trainguard: save of step %s failed, training continues: %s", step, e)
        warn_each(f"save of step {step} failed (on_error='warn'): {e}")  # a text per step: kept in no registry

    def wait(self) -> None:
        """Every rank: block until the save in flight is committed; raises its error (``on_error="warn"``: warns)."""
        try:
            self._finish_pending()
        except CheckpointError as e:
            self._report_failure(e, step=getattr(self, "_pending_step", None))

    def _require_open(self) -> None:
        if not self._opened:
            raise CheckpointError("CheckpointManager is not open: use `with CheckpointManager(...) as mgr:` or call open()")
