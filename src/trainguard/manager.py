"""``CheckpointManager``: when to save, what to keep, where to resume. Policy, not mechanism:
bytes move in ``api``/``io``; the manager decides and keeps the run directory tidy.

Every rank constructs the manager and calls ``restore``, ``save`` and ``close`` in the same
order. Rank 0 alone holds the run directory's lock, cleans debris, applies retention and
lists checkpoints; it shares its decisions with the other ranks through the store.

``close``/``__exit__``, ``wait`` and the failure reports are inherited from ``managerclose._ManagerClose``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any, SupportsIndex

from . import async_save, entrydrop, gradwatch, layout, partread, policies, retention, runlock, saveevent
from .api import start_save
from .async_save import use_staging
from .commit import RunLock, clean_debris
from .dist import DistContext
from .distwait import default_timeout
from .elastic import sharedstore, stops, watchdog
from .errors import CheckpointError, is_data_error
from .events import EVENTS_FILE, EventLog
from .handle import SaveHandle
from .inspect import not_overwritten, partly_read_refusal, touched_tensors, unmatched_entries
from .iostall import StuckWriteError
from .loader import load  # not tg.load (userload.py): restore falls back to older steps itself
from .managerclose import _ManagerClose
from .metricvals import MetricValue
from .onethread import one_thread_at_a_time
from .ownsteps import OwnSteps
from .permanent import check_manager_args, config_errors, flag, from_medium, is_permanent, mark, open_error
from .policies import EveryNSteps, KeepLatest, RetentionPolicy, SavePolicy
from .retention import DONE, apply_retention, remove_replaced, restore_candidates, set_aside, unrestored_error
from .runid import run_meta, run_restored  # which run wrote a checkpoint
from .stateful import check_state
from .storage import for_path
from .tiers import RamTier

log = logging.getLogger("trainguard")


@one_thread_at_a_time("open", "save", "wait", "restore", "close", rounds=("open", "restore"))
@watchdog.untimed("wait", "restore")  # not timed by the hang watchdog, as a save is not (watchdog.py)
class CheckpointManager(_ManagerClose):
    """Saves by policy, keeps by policy, restores the newest checkpoint that verifies.

    Every rank, in this order: construct, ``open()`` (or ``with``), ``restore``, ``save`` once per step,
    ``close()``; ``wait()`` any time after a save; one thread at a time. ``latest_step()``: any process.
    ``save``: a :class:`SavePolicy` (default ``EveryNSteps(1000)``); ``keep``: a :class:`RetentionPolicy`
    (default ``KeepLatest(3)``); ``async_save``: write in the background (``stage_in_background``: with no
    copy in the call, see docs/async.md); ``on_error``: ``"raise"`` or ``"warn"`` (log, train on, retry at the
    next save; a permanent error failing two saves in a row, or the run lock lost, is raised all the same); ``handle_signals``: on SIGTERM,
    SIGINT or SIGHUP (not if ignored or handled) save at the next ``save()``, set ``should_stop``; ``split_state``: see split.py."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        async_save: bool = False,
        layout: str = "sharded",
        on_error: str = "raise",
        handle_signals: bool = True,
        timeout: float | None = None,
        max_staging_bytes: int | None = None,
        ram_tier: bool | str | os.PathLike[str] | None = False,
        stage_in_background: bool = False,
        split_state: bool = False,
    ) -> None:
        with config_errors():  # a bad argument: no restart fixes it (exit 78 under `trainguard run`)
            check_manager_args(save, keep, layout, on_error, timeout, max_staging_bytes, async_save, stage_in_background, split_state, root, handle_signals, ram_tier)
        self.storage, self._root = for_path(root)  # first: a root of the wrong type (None) raises naming it
        self.root = os.fspath(root)
        self.save_policy = save if save is not None else EveryNSteps(1000)
        self.keep = keep if keep is not None else KeepLatest(3)
        self.async_save, self.layout, self.on_error, self.handle_signals = async_save, layout, on_error, handle_signals
        self.timeout, self.max_staging_bytes, self.stage_in_background, self.split_state = timeout, max_staging_bytes, stage_in_background, split_state
        self.ctx = DistContext.current().channel(f"manager:{os.path.basename(self._root.rstrip('/'))}")  # own rounds, named by the root's last part (another node may mount it elsewhere)
        self.events = EventLog(os.path.join(self._root, EVENTS_FILE) if self.storage.atomic_rename else None, rank=self.ctx.rank)
        policies.attach(self.save_policy, self.events, self)  # event log, exact durations; shared: refused
        self._lock = RunLock(self._root) if self.storage.atomic_rename else None
        self._pending: SaveHandle | None = None
        self._preempt = threading.Event()
        self._old_handlers: dict[int, Any] = {}  # the signal handlers open() replaced
        self._opened, self.should_stop, self._signum = False, False, 0  # _signum: this process's stop signal (policies.on_stop_signal)
        self.stopped_by: int | None = None  # the stop signal that ended the run (any rank's): exit_code
        self.last_saved_step: int | None = None
        self._metrics: dict[int, dict[str, float]] = {}
        self._created: dict[int, float] = {}  # step -> its manifest's `created`, for retention policies (rank 0)
        self._rejected: set[int] = set()  # steps restore() found unusable: replaced when saved again
        self._own = OwnSteps()  # steps this manager committed (the newest ones); any other one is an earlier run's (retention.py)
        self._restored: int | None = None  # the step restore() returned: saving an older one is refused
        # Warned of another run's newer checkpoints; set_aside's token; the last save failed permanently (_report_failure); optional RAM tier (tiers.py): saves go to /dev/shm first, rank 0 copies them here.
        self._warned_foreign, self._aside, self._failed_permanent = False, "", False
        self.ram = RamTier(ram_tier, root=self.root, durable=self.storage, durable_root=self._root, ctx=self.ctx, events=self.events, staging=(async_save, max_staging_bytes), on_error=on_error) if ram_tier else None

    def open(self) -> CheckpointManager:
        """Every rank, first: rank 0 takes the lock and cleans debris, then the ranks agree."""
        if self._opened:
            return self
        policies.attach(self.save_policy, self.events, self)  # again: one built with the same policy may have opened since
        err, exc = None, None
        try:  # a failed open (Ctrl-C during the debris cleanup too) leaves the directory unlocked
            if self.ctx.rank == 0:
                try:
                    layout.open_run_root(self.storage, self._root)  # not a checkpoint itself
                    sharedstore.warn_shared_store()  # plain torchrun: its restarts may hang (elastic/sharedstore.py)
                    if self._lock:
                        self._lock.acquire(wait=0.5 * (self.timeout or default_timeout()))  # an old incarnation's last save: stopwait.wait_free
                        runlock.release_when_gone(self, self._lock)  # dropped without close(): released when collected
                    removed = clean_debris(self.storage, self._root)
                    if removed:
                        log.warning("trainguard: removed debris of crashed saves in %s: %s", self.root, removed)
                        self.events.emit("debris", removed=removed)
                except Exception as e:  # root is a file, a store unreachable: tell the other ranks (open_error raises others)
                    exc = open_error(e, self.root)
                    err = [str(exc), is_permanent(exc)]
            err = self.ctx.broadcast("open", err, timeout=self.timeout)
            if err:
                other = CheckpointError(f"rank 0 could not open {self.root}: {err[0]}")
                raise exc if exc is not None else (mark(other) if err[1] else other)
            if self.ram:
                self.ram.open(self.timeout)  # every rank (a collective check that all share one node)
        except BaseException:
            if self._lock:
                self._lock.release()
            raise
        self._run_id = None  # runid.run_id reads it again: the directory may have been removed and begun anew since the last open
        self._opened, self._pid, self._ppid = True, os.getpid(), os.getppid()  # before the handlers: one that runs meanwhile sees an open manager (policies.on_stop_signal); _pid: forks.manager_call; _ppid: a parent-death SIGINT
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            hup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) in (signal.SIG_DFL, self._on_signal) else []
            for sig in (signal.SIGTERM, signal.SIGINT, *hup):  # SIGHUP (the agent forwards it) unless nohup'd or handled
                self._old_handlers.setdefault(sig, signal.signal(sig, self._on_signal))  # the first: a close() in another thread left it
        if self.async_save:
            use_staging(self)
        self.events.emit("manager_open", world_size=self.ctx.world_size, async_save=self.async_save)
        return self

    def __enter__(self) -> CheckpointManager: return self.open()

    def save(self, step: SupportsIndex, state: Mapping[str, Any], *, force: bool = False,
             metrics: Mapping[str, MetricValue] | None = None) -> SaveHandle | None:
        """Call once per training step on every rank; saves when the policy says so (or ``force``, or after SIGTERM/SIGINT). Returns its handle, or None."""
        self._require_open()
        agree = self.ctx.is_distributed and (self._needs_agreement() or self.handle_signals)
        if agree:  # every rank runs the "decide" round: numbered now, a Ctrl-C before it leaves the call (dist.py)
            self.ctx.rounds_follow()
        step = layout.check_step(step)
        check_state(state)  # a state that is no mapping: refused as by tg.save (permanent), not gradwatch's AttributeError
        watchdog.heartbeat(step)  # progress for `trainguard run`'s hang watchdog, and fault drills
        self.save_policy.on_step(step, now := time.monotonic())
        if (done := self._pending) is not None and done.done() and done.exception() is None:
            self._finish_pending()  # committed: the policy learns its cost now (DalyInterval), not at the next save's call
        want = flag("force", force) or self.save_policy.should_save(step, now)
        preempt = self._preempt.is_set()
        if agree:
            # Rank 0 decides for time-based policies and preemption (any rank's), so all ranks agree.
            want, preempt = policies.decide(self.ctx, want, preempt, self.timeout)
        if preempt:
            want = self.should_stop = True
            stops.note_stop(self, remote=True)
        gradwatch.at_save(state, step, saving=want and not gradwatch.saved_already(self, step))  # docs/checkpoints.md
        if not want:
            return None
        entrydrop.check(self, state, step)  # an entry earlier saves held: warned of now, not at the resume
        self.ctx.rounds_follow()  # every rank saves: a Ctrl-C in the wait for the previous save leaves it (dist.py)
        with watchdog.paused(self.timeout or default_timeout()):  # a save may outlast the hang timeout; a stuck write may not
            return self._save_now(step, state, metrics)

    def _needs_agreement(self) -> bool:
        return not isinstance(self.save_policy, EveryNSteps)

    def _save_now(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, MetricValue] | None, t0: float | None = None) -> SaveHandle | None:
        t0 = time.monotonic() if t0 is None else t0  # a retry to disk (below): the failed RAM attempt is stall too
        values, bad = policies.checked_metrics(metrics)  # a refusal is raised in the save's first round, on every rank
        bad = bad or runlock.lock_lost(self._lock)  # rank 0: the run directory's .lock removed or replaced (runlock.py)
        prev, live = self._pending, (getattr(async_save._INFLIGHT, "handle", None) if self.async_save else None)  # live: maybe another manager's (an EMA's): start_save waits for it, stall_prev_s too
        try:
            self._finish_pending()  # one save in flight: the wait counts as stall (not as the policy's: report_saved)
        except CheckpointError as e:
            self._report_failure(e, step=self._pending_step)
        waited = max(0.0, max(prev.finished_at or t0, prev.retained_at) - t0) if prev is not None else 0.0
        if step == self.last_saved_step and step not in self._rejected:
            # Saved already (a forced save after the policy's, a loop restarted at the restored step): kept.
            log.info("trainguard: step %d is already saved in %s; not saved again", step, self.root)
            return None
        self._own.check_save(step, self._restored)  # after restore(): a save behind it, or far behind this run's newest, is refused
        target = self.storage.join(self._root, layout.step_dir(step))
        meta = {"step": step, "metrics": values, **run_meta(self)}  # runid: which run wrote it
        saveevent.started(self, step, values)  # rank 0: its save_start event (trainguard report), the metrics for its retention
        try:  # RAM tier: the run directory when it has no room; its round ("ram_room") failing fails the save (on_error)
            storage, target = self.ram.target(step, self.timeout, state) if self.ram else (self.storage, target)
        except CheckpointError as e:
            self._report_failure(e, step=step)
            return None
        # A step restore found unusable, or left by an earlier run after the restored step: replaced (without restore(): refused, as by tg.save).
        replace = step in self._rejected or (self._restored is not None and step not in self._own)
        durable = self.storage.join(self._root, layout.step_dir(step))
        if replace and self.ctx.rank == 0 and (self.ram or not self.storage.atomic_rename):
            bad = bad or remove_replaced(self, durable)  # no atomic replace on object stores, nor of the RAM tier's copy
        if self.ctx.rank == 0 and self._restored is not None and not self.ram:  # newer steps of an abandoned timeline
            bad = bad or set_aside(self, step, meta)
        mark = policies.decision_mark(self.ctx)  # before the save: a sync one's rounds follow it
        try:
            handle = start_save(
                storage, target, state, self.ctx,
                async_=self.async_save, layout=self.layout, metadata=meta, timeout=self.timeout, step=step,
                max_staging_bytes=self.max_staging_bytes, stage_in_background=self.stage_in_background, split_state=self.split_state,
                overwrite=replace and storage.atomic_rename, preflight=self.ram.preflight(step, bad) if self.ram else bad, managed=True,
            )
        except CheckpointError as e:
            if self.ram and not self.async_save and self.ram.no_room(step, e):  # every rank: the same error, answer
                return self._save_now(step, state, metrics, t0)  # again, straight to the run directory (RamTier.target)
            self._report_failure(unrestored_error(e, step, self._restored), step=step)
            return None
        except BaseException as e:  # a Ctrl-C after the save's thread started (async_save.py): it commits; collect it
            if (started := getattr(e, "save_handle", None)) is not None:
                self._track(started, step, t0, mark, waited)
            raise
        return self._track(handle, step, t0, mark, waited if live is None else max(waited, max(live.finished_at or t0, live.retained_at) - t0))

    def _track(self, handle: SaveHandle, step: int, t0: float, mark: Any, waited: float) -> SaveHandle:
        if self.async_save and self.ctx.rank == 0:  # at the commit, on the save thread (here if committed already):
            retention.at_commit(self, handle, time.monotonic)  # retention, or the RAM tier's copy to disk
        handle.stall_s, handle.prev_wait_s = time.monotonic() - t0, waited
        saveevent.at_commit(self, handle, step, t0)  # async, every rank: its save event as it commits, before retention
        handle.owned = True  # its error is reported by this manager, not by another's next save
        self._pending, self._pending_step, self._pending_t0, self._pending_mark = handle, step, t0, mark
        if not self.async_save:  # an async save that already failed reports at the next save/wait/close
            self._finish_pending()
        return handle

    def _finish_pending(self) -> None:
        h = self._pending
        if h is None:
            return
        seen = h.observed  # the caller collected its error with handle.result(): recorded, not raised again
        try:  # bounded: a storage call in flight for the timeout raises StuckWriteError (iostall.py)
            manifest = h.result_bounded(self.timeout or default_timeout(), self.ctx.rank)
        except Exception as e:  # not a wait cut short (Ctrl-C): that leaves it for the next save/wait/close
            self._pending = h if isinstance(e, StuckWriteError) else None  # stuck: it stays in flight
            err = unrestored_error(e, self._pending_step, self._restored) if isinstance(e, CheckpointError) else CheckpointError(f"background save of step {self._pending_step} failed: {e}")
            if not seen:
                raise err from (e.__cause__ if err is e else e)  # a CheckpointError as itself, its cause kept
            self.events.emit("save_failed", step=self._pending_step, error=str(err)[:2000], collected=True)
            return log.warning("trainguard: save of step %s failed (collected by handle.result()): %s", self._pending_step, err)
        self._pending = None
        h.duration_s = (h.finished_at or time.monotonic()) - self._pending_t0  # when it ended (collected later)
        self.last_saved_step, self._failed_permanent = manifest.step, False
        self._own.add(manifest.step)
        if self.ctx.rank == 0:  # a full manifest here (elsewhere a lazy one would read it)
            retention.committed_facts(self, manifest)  # when saved, its files' sizes
            policies.forget_decisions(self.ctx, self._pending_mark)  # every rank read the decisions up to it
        self._rejected.discard(manifest.step)
        # Stall = the save() call (incl. waiting for the previous save) + optimizer pre-step + wait_staged() waits.
        stall = h.stall_s + h.hook_wait_s + h.wait_staged_s
        saveevent.at_sync_commit(self, h, manifest.step, stall, manifest.total_bytes)  # before retention: a kill in it keeps it
        r0 = time.monotonic()
        if self.ram:
            self.ram.committed(manifest.step, self._apply_retention, manifest.total_bytes)
        elif self.ctx.rank == 0 and h.retained_at < 0:  # not run at the commit (retention.at_commit)
            self._apply_retention(manifest.step)
        stall += saveevent.retention_waited(self, manifest.step, time.monotonic() - r0)  # sync: training waited for it
        policies.report_saved(self, h, manifest.step, stall, manifest.total_bytes)  # to the policy and the event log

    def _apply_retention(self, newest: int) -> None:
        apply_retention(self, newest)  # after `newest` is committed, on rank 0, holding the lock (retention.py)

    def restore(self, state: Mapping[str, Any], *, strict: bool = True, step: SupportsIndex | None = None) -> int | None:
        """Load the newest checkpoint that loads and verifies; fall back to older ones (logging
        why). Returns its step, or None on a fresh start. Every rank calls it; it first waits for an async save in flight
        (``wait``; and the RAM tier's copy to disk). ``step``: the newest at or before it (a rollback: the newer ones go when this run's first save commits)."""
        self._require_open()
        self.wait()  # an async save in flight still reads the tensors this writes into
        if self.ram:  # rank 0: its copy to disk and that copy's retention end before the listing, not during the load
            self.ram.wait()
        at = None if step is None else layout.check_step(step)
        with config_errors():
            check_state(state)  # on a fresh start too: not first found at the run's first resume
        gradwatch.watch(state)  # from here on a save mid-accumulation is warned about (gradwatch.py)
        t0 = time.monotonic()
        candidates = self.ctx.broadcast("candidates", restore_candidates(self) if self.ctx.rank == 0 else None, timeout=self.timeout)
        if isinstance(candidates, dict):  # rank 0 could not list the run directory: every rank raises it
            raise CheckpointError(f"restore: cannot list {self.root}: {candidates['error']}")
        candidates = retention.at_or_before(candidates, at, self.root)  # none at or before: an error naming those held
        skipped: list[str] = []
        touched: dict[str, list[int] | None] = {}  # tensors a skipped checkpoint may have written into, their shapes
        medium = False  # a skip for a medium's error: finding nothing usable is then no permanent failure
        for step, path, tier in retention.tries(self, candidates, at):  # listed again once all failed
            try:
                m = load(path, state, strict=strict, timeout=self.timeout, split_state=self.split_state)
            except CheckpointError as e:
                if not is_data_error(e):
                    raise retention.older_holds(e, candidates, step) from e.__cause__  # the state does not fit
                medium = medium or from_medium(e)
                log.warning("trainguard: checkpoint of step %d is not usable, trying an older one: %s", step, str(e))
                self.events.emit("restore_skip", step=step, reason=str(e)[:2000])
                self._rejected.add(step)
                skipped.append(partread.skip_line(step, path, e))  # names the step and the directory once
                touched.update(touched_tensors(path, state, e))
                continue
            left = not_overwritten(touched, m, state)
            if left:  # strict=False: the older checkpoint does not overwrite them
                raise partly_read_refusal(left, touched, step)
            if not strict and self.ctx.rank == 0 and (line := unmatched_entries(state, m, self.split_state)):
                log.warning("trainguard: %s", line)  # an optimizer added since the save: said, not silent
            self._aside = "" if self._aside == DONE else self._aside  # a token never committed stays (set_aside)
            self.last_saved_step, self._restored = step, step
            self._own.roll_back(step)
            self._rejected.discard(step)  # its RAM copy failed, its durable one loaded: usable (tiers.RamTier.restored)
            self.events.emit("restore", step=step, seconds=round(time.monotonic() - t0, 6), source=path, tier=tier, **run_restored(self, step, path, m.metadata))
            if self.ram:
                self.ram.restored(step, tier, lambda _s: None, m.total_bytes)  # retention: at the first commit, not here
            return step
        if skipped:  # never a silent fresh start over a state that the failed loads partly overwrote
            none = CheckpointError(
                f"restore: none of the {len(skipped)} checkpoint(s) in {self.root} could be loaded (newest first):\n"
                + "\n".join(skipped)
                + "\nThe state may hold part of what was read. Find the cause (`trainguard verify <step dir>`), or "
                "move the checkpoints away to start fresh"
            )
            raise none if medium else mark(none)  # bad bytes are read again at every restart
        self.events.emit("fresh_start", skipped=0)
        return None

    def latest_step(self) -> int | None:
        """The newest committed step (manifest present, in the run directory or the RAM tier; not verified). Any process; no collective."""
        return retention.newest_step(self)  # the RAM tier's newest too

