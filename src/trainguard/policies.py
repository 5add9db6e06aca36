"""When to save and which checkpoints to keep. Pure policy: no I/O, no torch.distributed.

The manager calls, on every rank and in this order, for every ``mgr.save(step, state)``:

1. ``save_policy.on_step(step, now)``: a heartbeat with the training loop's clock;
2. ``save_policy.should_save(step, now)``: must return the same answer on every rank (all
   built-in policies are deterministic functions of step and of values agreed at start;
   time-based policies are decided on rank 0 and broadcast by the manager);
3. after a save was staged/committed, ``save_policy.on_saved(step, stall_s, duration_s)``.

Retention runs on rank 0 only, after a new checkpoint is committed:
``keep.select(checkpoints) -> set of steps to keep``. The manager additionally never deletes
the checkpoint it just committed nor anything before it is committed; checkpoints with newer
steps that it did not write (an earlier run's, which this run went back behind after its
``restore`` returned an older step) are removed whatever the policy says (``retention.retain``).

The manager's per-step decide round and stop-signal handlers live in ``stopping.py`` (re-exported here).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from . import saveevent
from .errors import whole
from .metricvals import checked_metrics, metric_values  # noqa: F401  (manager.py, tests)
from .permanent import flag
from .stopping import (  # noqa: F401  (moved there; manager.py and forks.py call them here)
    chain_preemption,
    decide,
    decision_mark,
    forget_decisions,
    on_stop_signal,
    unchain_handlers,
)


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention policies see of one committed checkpoint: its step, ``created`` (the wall
    time, ``time.time()``, at which its manifest was built: a policy such as "one per day" reads
    it; 0.0 when the manifest could not be read) and the metrics saved with it."""

    step: int
    created: float
    metrics: dict[str, float] = field(default_factory=dict)


class SavePolicy(ABC):
    """Base class of save policies: when should the manager write a checkpoint?"""

    def on_step(self, step: int, now: float) -> None:
        """Called by the manager at every ``save()`` call (one per training step); optional hook."""
        return None

    @abstractmethod
    def should_save(self, step: int, now: float) -> bool:
        """True when a checkpoint should be written at this step (same answer on every rank)."""

    def on_saved(self, step: int, stall_s: float, duration_s: float) -> None:
        """Called after a save: ``stall_s`` the time training was blocked, ``duration_s`` the whole save; optional hook."""
        return None

    def describe(self) -> str:
        return repr(self)


class EveryNSteps(SavePolicy):
    """Save when ``step % n == 0`` (and ``step > 0`` unless ``at_start=True``)."""

    def __init__(self, n: SupportsIndex, *, at_start: bool = False) -> None:
        self.n, self.at_start = whole(n), at_start  # before the checks: a refused one's repr (a traceback's locals) works
        if type(self.n) is not int or self.n < 1:  # a numpy int is one (errors.whole), a bool or 2.0 is not
            raise ValueError(f"EveryNSteps(n={n!r}): n must be a positive integer number of steps")
        self.at_start = flag("at_start", at_start)  # True or False, as tg.save's: at_start="no" (truthy) saved step 0

    def should_save(self, step: int, now: float) -> bool:
        if step == 0 and not self.at_start:
            return False
        return step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n!r}{', at_start=True' if self.at_start else ''})"


class EverySeconds(SavePolicy):
    """Save when at least ``seconds`` of wall time passed since the last save (or the start)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # as given until checked: a refused one's repr (a traceback's locals) works
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not seconds > 0:
            raise ValueError(f"EverySeconds(seconds={seconds!r}): seconds must be a number > 0")
        self.seconds = float(seconds)
        self._last: float | None = None
        self._decided: list[int] = []  # steps it said yes to whose on_saved has not come yet
        self._prev: int | None = None  # the step of the previous on_step

    def on_step(self, step: int, now: float) -> None:
        """Starts the clock at the first step. A step behind the previous one (a rollback)
        forgets the steps decided on the old timeline: one whose save failed is no save when
        the loop comes back to it (the clock decides, as for any step)."""
        if self._prev is not None and step < self._prev:
            self._decided = []
        self._prev = step
        if self._last is None:
            self._last = now

    def should_save(self, step: int, now: float) -> bool:
        """Saying yes restarts the clock at once: an async save's ``on_saved`` comes a save
        later, and every step until then must not be a save too. Asked twice for one step,
        the same answer."""
        if step in self._decided:
            return True
        if self._last is None or now - self._last < self.seconds:
            return False
        self._decided = [*self._decided[-7:], step]
        self._last = now
        return True

    def on_saved(self, step: int, stall_s: float, duration_s: float) -> None:
        if step in self._decided:
            self._decided.remove(step)
        else:
            self._last = None  # a save the policy did not ask for (forced): the clock restarts at the next step

    def __repr__(self) -> str:
        return f"EverySeconds({self.seconds:g})" if isinstance(self.seconds, float) else f"EverySeconds({self.seconds!r})"


class RetentionPolicy(ABC):
    """Base class of retention policies: which committed checkpoints to keep."""

    #: Whether ``select`` reads ``created`` or ``metrics``. Where False (policies of steps
    #: alone), the manager passes 0.0 and ``{}`` instead of reading every kept checkpoint's
    #: manifest at the first retention after a restart.
    reads_metadata: bool = True

    @abstractmethod
    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The steps to keep among the committed ``checkpoints``. Called by the manager on rank 0 only,
        after each commit; the newest checkpoint is kept whatever this returns."""

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        if not isinstance(other, RetentionPolicy):
            raise TypeError(f"{self!r} | {other!r}: combine retention policies, e.g. KeepLatest(3) | KeepEvery(10_000)")
        return KeepUnion(self, other)


class KeepAll(RetentionPolicy):
    """Never delete anything."""

    reads_metadata = False

    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints}

    def __repr__(self) -> str:
        return "KeepAll()"


class KeepLatest(RetentionPolicy):
    """Keep the ``n`` newest checkpoints."""

    reads_metadata = False

    def __init__(self, n: SupportsIndex) -> None:
        self.n = whole(n)  # before the check: a refused one's repr (a traceback's locals) works
        if type(self.n) is not int or self.n < 2:
            raise ValueError(
                f"KeepLatest({n!r}): keep at least 2 checkpoints: the newest one may be incomplete "
                "or corrupt when the job dies, and then the one before it is all you have"
            )

    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n :]}

    def __repr__(self) -> str:
        return f"KeepLatest({self.n!r})"


class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of ``k`` forever (combine with ``|``)."""

    reads_metadata = False

    def __init__(self, k: SupportsIndex) -> None:
        self.k = whole(k)  # before the check: a refused one's repr (a traceback's locals) works
        if type(self.k) is not int or self.k < 1:
            raise ValueError(f"KeepEvery({k!r}): k must be a positive number of steps")

    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.k == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.k!r})"


class KeepBest(RetentionPolicy):
    """Keep the ``n`` checkpoints with the best ``metric`` (passed as ``mgr.save(..., metrics={...})``).

    Checkpoints without the metric, or with a NaN or infinite value (either sign, in either
    mode: a diverged run's, never its best), rank last, the newest first among them.
    """

    def __init__(self, metric: str, n: SupportsIndex = 1, mode: str = "min") -> None:
        self.metric, self.n, self.mode = metric, whole(n), mode  # before the checks: a refused one's repr works
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"KeepBest(metric={metric!r}): name the metric, a str key of mgr.save(..., metrics={{...}})")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode={mode!r}): mode must be 'min' or 'max'")
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"KeepBest(n={n!r}): n must be a positive integer")

    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0

        def key(c: CheckpointInfo) -> tuple[int, float, int]:
            v = c.metrics.get(self.metric)
            try:  # an int past a float's range (OverflowError) ranks last, as ±inf does
                f = float(v) if isinstance(v, (int, float)) else math.nan
            except OverflowError:
                f = math.nan
            return (0, sign * f, -c.step) if math.isfinite(f) else (1, 0.0, -c.step)

        return {c.step for c in sorted(checkpoints, key=key)[: self.n]}

    def __repr__(self) -> str:
        return f"KeepBest({self.metric!r}, n={self.n!r}, mode={self.mode!r})"


class KeepUnion(RetentionPolicy):
    """Keep what any of the policies keeps: ``KeepLatest(3) | KeepEvery(10_000)``."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = policies
        self.reads_metadata = any(p.reads_metadata for p in policies)

    def select(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.select(checkpoints)
        return out

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


def attach(policy: SavePolicy, events: Any, manager: Any = None) -> None:
    """The manager's constructor and ``open``: gives the save policy its event log (where it has an unset ``events``) and
    says the durations it will report end at the commit (``exact_durations``: not an upper bound to cap).
    A policy with state (its own ``on_step``/``on_saved``: ``EverySeconds``, ``DalyInterval``) that an open
    manager already uses is refused: the two ran on one clock, and the second manager, asked after the
    first saved, never saved (seen: ``save=pol`` for a model's and an EMA's manager, the EMA's run empty). At
    ``open`` too: two managers built before either opened (``a, b = CM(.., save=pol), CM(.., save=pol)``;
    ``with a, b:``) passed the constructor's check, and ``b`` saved once in 30 steps."""
    stateful = type(policy).on_step is not SavePolicy.on_step or type(policy).on_saved is not SavePolicy.on_saved
    other = getattr(policy, "_trainguard_manager", lambda: None)() if manager is not None and stateful else None
    if other is not None and other is not manager and getattr(other, "_opened", False):
        raise ValueError(f"save={policy!r} is already the save policy of the open CheckpointManager of {other.root}: a "
                         "policy keeps its manager's timing, and two managers sharing one saved on each other's clock "
                         f"(one saved nothing). Give each manager its own: save={policy!r} for each; or close() that "
                         "manager first (one opened without `with` and dropped stays open until closed)")
    if manager is not None and stateful:
        try:
            policy._trainguard_manager = weakref.ref(manager)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # __slots__, a frozen dataclass: not checked
            pass
    if getattr(policy, "events", "absent") is None:
        policy.events = events  # type: ignore[attr-defined]
    if hasattr(policy, "exact_durations"):
        policy.exact_durations = True  # type: ignore[attr-defined]
    if (manager is not None and getattr(events, "path", None) is not None and callable(getattr(policy, "seed_from_log", None))
            and getattr(getattr(manager, "ctx", None), "rank", 0) == 0 and _resumed(os.path.dirname(events.path))):
        policy.seed_from_log(events.path)  # DalyInterval: an earlier process's save costs (rank 0's decisions: decide)


def _resumed(run_dir: Any) -> bool:
    """``attach``: whether ``run_dir`` holds a step directory (a run to resume), so that its event log is this run's:
    in an emptied one (``rm -rf run/step-*``, the name reused by a new experiment) it was another's (review56j)."""
    from .layout import STEP_RE
    try:
        with os.scandir(run_dir) as it:
            return any(STEP_RE.match(e.name) for e in it)
    except OSError:  # none yet (a new run), unreadable: measured as in a new run
        return False


def report_saved(manager: Any, h: Any, step: int, stall: float, total_bytes: int) -> None:
    """The manager's ``_finish_pending``, once the save of ``step`` committed: tells its save policy what the
    save cost and logs the ``save`` event. ``stall`` counts every second training was blocked for it, the
    wait for the previous save (``h.prev_wait_s``) included; the policy gets the save's own stall and
    duration, without that wait: it is the cost of saving more often than a save takes, which the
    policy's interval must fix, not grow with (DalyInterval's floor). The event: ``saveevent.py``."""
    own = min(h.prev_wait_s, stall, h.duration_s)
    on_saved = manager.save_policy.on_saved  # DalyInterval's takes the wait apart; a policy of the user's may not
    try:
        waited = {"waited_s": own} if "waited_s" in inspect.signature(on_saved).parameters else {}
    except (TypeError, ValueError):  # a callable without a signature (built in C): the three arguments only
        waited = {}
    on_saved(step, stall - own, h.duration_s - own, **waited)
    if not getattr(h, "logged", False):  # logged as it commits (saveevent.at_commit, at_sync_commit)
        saveevent.emit(manager.events, h, step, stall, h.duration_s, total_bytes, async_save=manager.async_save)
