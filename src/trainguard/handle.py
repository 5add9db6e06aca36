"""``SaveHandle``: what a save returns. Sync saves hand back one that is already done; the
async path (``async_save``) completes it from its save thread.

Who touches what: the training thread calls the query methods (``staged``, ``done``,
``wait_staged``, ``result``); the save thread calls ``set_staged``/``set_result``/``set_error``
exactly once each at most; the optimizer pre-step hook adds to ``hook_wait_s``.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

from . import gcpause, iostall
from .errors import CheckpointError

log = logging.getLogger("trainguard")


def _seconds(timeout: Any, call: str) -> float | None:
    """``result``/``wait_staged``'s ``timeout``: seconds >= 0 or None (``"5"`` failed inside ``threading``
    with "'<' not supported between instances of 'str' and 'int'"), as a float; any real number
    (``np.int64(5)``, refused by c64c550, waited before it); ``math.inf`` and what ``threading`` cannot
    wait for (past ``threading.TIMEOUT_MAX``: "OverflowError: timestamp out of range") wait like None."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise TypeError(f"{call}(timeout={timeout!r}): pass seconds (a number >= 0), or None to wait until it is done")
    return None if timeout >= threading.TIMEOUT_MAX else float(timeout)


class SaveHandle:
    """Progress of one save: ``staged()`` (training may mutate the state again), ``done()``
    (committed or failed), ``result(timeout)`` (the manifest, or the save's error raised).

    Stall accounting: ``call_s`` is the time the save call blocked; ``hook_wait_s`` the time
    ``optimizer.step()`` waited for the background copies; ``wait_staged_s`` the time callers
    of ``wait_staged()`` waited for them; ``stall_s`` is set by the manager (its whole
    ``save()`` call, including the wait for the previous save).
    ``staged_sync_bytes``/``staged_background_bytes``/``staging_batches``: what the async path
    copied into host memory on this rank (see ``docs/async.md``).
    """

    def __init__(self, step: int | None = None, target: str = "") -> None:
        self.step = step
        self.target = target  # where the save writes (start_async_save), for messages about it
        self._staged = threading.Event()
        self._done = threading.Event()
        self.waiting = threading.Event()  # set when step() or wait_staged() starts waiting for staging
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.observed = False  # result() was called: its error (if any) has been seen
        self.owned = False  # a CheckpointManager collects it (its error is the manager's to report)
        self.stuck = False  # a storage call of its thread was found stuck (result_bounded)
        # Set by async_save.start_async_save: the save's timeout (the manager's) and this rank, which
        # bound the waits for staging (block_until_staged) and the join at interpreter exit.
        self.limit: float | None = None
        self.rank = 0
        self.gc_hold = 0  # gcpause.hold's token: the collector waits for the save thread (released when it ends or is stuck)
        # Called with the manifest by the save thread once committed, before done() turns true, in
        # order (the manager's save event, then its retention or the RAM tier's copy to disk: at once,
        # not at the next save); added with after_commit(), which also runs one if the save committed before.
        self.on_commit: list[Callable[[Any], None]] = []
        self._commit_lock = threading.Lock()
        self._committed = False
        self.logged = False  # its save event is written (saveevent.at_commit): the manager does not log it again
        self.stall_s = 0.0
        self.call_s = 0.0
        self.hook_wait_s = 0.0
        self.wait_staged_s = 0.0
        self.duration_s = 0.0
        self.prev_wait_s = 0.0  # set by the manager: how long its save() waited for the previous save to commit
        self.retained_at = -1.0  # the manager's clock when retention ended on the save thread (retention.at_commit)
        self.finished_at: float | None = None  # time.monotonic() when committed or failed
        self.bytes = 0
        # Host staging (async saves): bytes copied in the call (buffers, RNG, plain tensors, whole),
        # bytes of this rank's parameter/optimizer chunks copied by the save thread, and in how
        # many batches (1 unless ``max_staging_bytes`` made it copy, write, copy, ...).
        self.staged_sync_bytes = 0
        self.staged_background_bytes = 0
        self.written_live_bytes = 0  # zero-copy: protected chunks written from the live tensors
        self.staging_batches = 0
        # Async saves: the leaves the save thread copies later and their tensors' version counters at
        # the call (``watch``); ``set_staged`` lists the ones changed in place before then here.
        self._watched: list[Any] = []
        self._versions: list[int | None] = []
        self.modified_while_staging: list[str] = []

    def staged(self) -> bool:
        """True once the save no longer reads the live tensors."""
        return self._staged.is_set()

    def done(self) -> bool:
        """True once the save is committed or failed."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until ``staged()``; call it before mutating parameters outside ``optimizer.step()``.
        Tells a zero-copy save that someone waits: it copies what it has not written yet."""
        timeout = _seconds(timeout, "wait_staged")
        ok, waited = self.block_until_staged(timeout)
        self.wait_staged_s += waited
        return ok

    def block_until_staged(self, timeout: float | None = None) -> tuple[bool, float]:
        """``wait_staged`` without the accounting: (staged, seconds waited). The optimizer
        pre-step hook waits so and adds the time to ``hook_wait_s`` instead."""
        if self._staged.is_set():
            return True, 0.0
        self.waiting.set()
        t0 = time.monotonic()
        if self.limit is None:
            return self._staged.wait(timeout), time.monotonic() - t0
        # A staging cap (max_staging_bytes) copies, writes, copies...: a write stuck in between
        # holds staged() back for good. Raise StuckWriteError (what the manager's next save, wait
        # or close would say) rather than hold step() or a load silently (the other ranks then
        # wait in their next collective); the save stays in flight.
        end = None if timeout is None else t0 + timeout
        every = min(self.limit / 4, 5.0)
        while not self._staged.wait(every if end is None else max(0.0, min(every, end - time.monotonic()))):
            late = iostall.oldest(self.target)  # this save's calls only (another thread's save is not stuck here)
            if late is not None and late[0] >= self.limit and not self._done.is_set():
                self.stuck = True  # the interpreter's exit does not wait for it (async_save._drain_at_exit)
                raise iostall.stuck_error(self.step, self.rank, late[0], late[1], self.limit)
            if end is not None and time.monotonic() >= end:
                return False, time.monotonic() - t0
        return True, time.monotonic() - t0

    def result(self, timeout: float | None = None) -> Any:
        """The committed manifest; raises the save's error. Joins the save thread when done."""
        timeout = _seconds(timeout, "result")
        if not self._done.wait(timeout):
            raise TimeoutError(f"save {f'of step {self.step}' if self.step is not None else f'to {self.target}'} not finished after {timeout} s")
        self.join()
        self.observed = True
        if self._error is not None:
            raise self._error
        return self._result

    def result_bounded(self, limit: float, rank: int) -> Any:
        """``CheckpointManager`` (training thread, every rank, at its next save/wait/close): ``result()``,
        but a storage call of the save thread in flight for ``limit`` seconds raises ``StuckWriteError``
        (``iostall.py``); the save stays in flight. Looks every ``limit / 4`` s (at most 5 s)."""
        while True:
            try:
                return self.result(min(limit / 4, 5.0))
            except TimeoutError:
                if self._done.is_set():  # the save's own error, or it ended as the wait ran out: its outcome
                    return self.result()  # (the wait's TimeoutError was raised as the save's: a committed save "failed")
            late = iostall.oldest(self.target, self._thread.ident if self._thread is not None else None)
            if late is not None and late[0] >= limit and self._thread is not None:
                self._found_stuck()
                raise iostall.stuck_error(self.step, rank, late[0], late[1], limit)

    def exception(self) -> BaseException | None:
        """The save's error once it is done (``None`` while in flight or after a success); the
        caller's thread, any time, without waiting or raising (``result()`` raises it)."""
        return self._error if self._done.is_set() else None

    @property
    def total_stall_s(self) -> float:
        """What the training loop lost to this save: the call plus the waits for staging."""
        return max(self.stall_s, self.call_s) + self.hook_wait_s + self.wait_staged_s

    # -- completion, called by whoever runs the save
    def attach_thread(self, thread: threading.Thread) -> None:
        """Internal: ``async_save`` hands over the save thread it started, for ``join``."""
        self._thread = thread

    def join(self, limit: float | None = None) -> None:
        """Wait for the save thread to exit (no-op for sync saves or from the thread itself). With
        ``limit`` (``async_save._finish_previous``: the next save of any manager, or a direct one),
        a storage call of it in flight for ``limit`` seconds raises ``StuckWriteError`` (``iostall``)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            if limit is None:
                return t.join()
            try:
                iostall.join_bounded(t, limit, f"the async save of step {self.step} (to {self.target})", self.target)
            except iostall.StuckWriteError:
                self._found_stuck()
                raise

    def _found_stuck(self) -> None:
        """A storage call of the save thread is stuck: it may never end, so neither the interpreter's
        exit (async_save._drain_at_exit) nor Python's collector (gcpause.hold) waits for it any more."""
        self.stuck = True
        gcpause.release(self.gc_hold)

    def watch(self, leaves: list[Any]) -> None:
        """Training thread, in the async save call (every rank, ``async_save.start_async_save``):
        ``leaves`` (``capture.Leaf``s: ``.path``, ``.tensor``) are what the save thread copies after
        the call returns. A tensor changed in place before they are all copied (an EMA or clamp of
        the weights, a ``load_state_dict``, Adam's moments reset: anything but ``step()``, which
        waits) bumps its version counter; ``set_staged`` then warns, naming it. A write through
        ``.data`` bumps no counter and goes unseen (docs/async.md). Kept as the leaves and a list
        of ints, no object per tensor (planner.full_box says why)."""
        self._watched = leaves
        try:  # one attribute read each, no Python call per tensor
            self._versions = [lf.tensor._version for lf in leaves]
        except (RuntimeError, AttributeError):  # an inference tensor has no counter: None for it
            self._versions = [_version(lf.tensor) for lf in leaves]

    def set_staged(self) -> None:
        """Save thread: the last tensor of the save is copied (or written); step() may run again."""
        if not self._staged.is_set() and self._watched:
            changed = [lf.path for lf, v in zip(self._watched, self._versions, strict=True)
                       if v is not None and _version(lf.tensor) != v]
            self._watched, self._versions = [], []
            if changed:
                self.modified_while_staging = changed
                log.warning(
                    "trainguard: %d tensor(s) of the async save %s were changed in place after save() returned "
                    "and before the save had copied them (%s): the checkpoint may hold the changed values, not those at "
                    "the call. Call handle.wait_staged() before changing parameters or optimizer state outside "
                    "optimizer.step() (EMA, clamping, load_state_dict, re-initialisation); see docs/async.md",
                    len(changed), f"of step {self.step}" if self.step is not None else f"to {self.target}", ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else ""),
                )
        self._staged.set()

    def after_commit(self, cb: Callable[[Any], None], *, first: bool = False) -> None:
        """Training thread, right after the save call: run ``cb(manifest)`` once the save commits,
        on the save thread, or now if the save thread committed it already (it may win the race
        to here); exactly once either way, never for a failed save. Callbacks run in the order
        added; ``first``: before those added earlier (``saveevent.at_commit``: the save event is
        written before retention deletes, a process killed in between still logged the save)."""
        with self._commit_lock:
            now = self._committed
            if not now and not self._done.is_set():  # set_error clears it after _done.set(), under this lock
                # kept until the commit (or failure) only: it holds the manager (retention.at_commit)
                self.on_commit.insert(0 if first else len(self.on_commit), cb)
        if now:
            self._run_commit_callback(cb, self._result)

    def _run_commit_callback(self, cb: Callable[[Any], None], value: Any) -> None:
        try:
            cb(value)
        except Exception as e:  # the checkpoint is committed; the callback's failure is its own
            log.warning("trainguard: after the commit of step %s: %s", self.step, e)

    def set_result(self, value: Any) -> None:
        """Internal: the save thread (sync saves: the caller) marks the save committed, then runs
        ``on_commit`` (the manager's bookkeeping) once."""
        self._result = value
        self.finished_at = time.monotonic()
        self._staged.set()
        with self._commit_lock:
            self._committed = True
            # Dropped: the process's last async save stays referenced (async_save._INFLIGHT) after close(),
            # and through this callback so did its closed CheckpointManager, never garbage-collected.
            cbs, self.on_commit = self.on_commit, []
        for cb in cbs:
            self._run_commit_callback(cb, value)
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        """Internal: the save thread (or ``async_save._failed``, ``forked_off``) records the failure
        that ``result()``/``wait()`` raise and the next ``save()``/``close()`` reports."""
        self._error = error
        self.finished_at = time.monotonic()
        self._staged.set()
        self._done.set()
        with self._commit_lock:  # never runs for a failed save: not kept (it holds the manager, set_result)
            self.on_commit = []

    def forked_off(self, parent: int) -> None:
        """In a process forked while this save was in flight (``async_save``'s at-fork hook): the
        save thread runs in the parent only, so ``result()`` here raises instead of waiting forever.
        New events: a lock of the old ones may have been held by a thread the child does not have."""
        self._staged, self._done, self.waiting, self._thread = threading.Event(), threading.Event(), threading.Event(), None
        self.set_error(CheckpointError(
            f"the async save to {self.target} runs in process {parent}, which forked this one: its outcome is known only there"
        ))

    @classmethod
    def completed(cls, value: Any, step: int | None = None) -> SaveHandle:
        h = cls(step)
        h.set_result(value)
        return h


def _version(t: Any) -> int | None:
    """A tensor's in-place version counter; None for one that has none (an inference tensor)."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):
        return None
