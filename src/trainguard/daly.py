"""``DalyInterval``: a save policy that measures what a save costs and the step time and saves at Daly's optimum.

The manager calls it like every :class:`~trainguard.policies.SavePolicy`, on every rank, in
this order for each ``mgr.save(step, state)``: ``on_step`` -> ``should_save`` -> (after a save)
``on_saved(step, stall_s, duration_s)``, where ``stall_s`` is the time training was blocked
(for an async save: the blocking part only) and ``duration_s`` the whole save until commit.

Same answer on every rank: ``should_save`` is a function of the step and of ``next_step``,
which moves only when ``should_save`` says yes (by the current interval) and inside
:meth:`DalyInterval.on_saved`. The values the interval is computed from (stall, duration, step
time) are measured per rank and may differ slightly, so a multi-rank manager either broadcasts
rank 0's decision every step (trainguard's manager does this for every policy but
``EveryNSteps``), or broadcasts rank 0's :meth:`DalyInterval.measurements` after ``on_saved``
and calls :meth:`DalyInterval.agree` with them on every rank, which recomputes the interval
from those values alone (``needs_agreement`` is True to say so).

The manager may set ``policy.events`` (an :class:`~trainguard.events.EventLog`, or None); every
choice of interval is then logged as an ``"interval"`` event with the reason.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Iterator
from typing import Any, SupportsIndex

from .errors import whole
from .events import parse_line, text_lines
from .policies import SavePolicy
from .reliability import daly_interval, format_duration, job_mtbf

RESUME_TAIL = 1 << 20  # bytes of the run's event log DalyInterval.seed_from_log reads at a time, from its end back
RESUME_SCAN = 64 << 20  # ... and at most: an earlier process's costs further back are not looked for
_MARK = b'"event": "interval"'  # in each interval line EventLog writes (json.dumps escapes a quote inside a string)
SAMPLES_PER_SAVE = 4096  # step-time samples kept per save until it is reported (its slowdown: DalyInterval._slowdown)


TRIM = 0.1  # the slowest tenth of a save's steps is not its doing (an evaluation, a new epoch): see _excess


def _excess(busy: list[tuple[float, float, int]], base: float, blocked: float) -> float:
    """``DalyInterval._slowdown``: the training time the step-time samples ``busy`` (start, s per step,
    steps; in time order) took beyond ``base`` per step, less ``blocked`` (the save's stall and wait, in
    its first samples: the call, then the optimizer's pre-step waits), taken from them first. The
    slowest ``TRIM`` of the steps then are left out and the rest's mean excess counts for every step:
    a save's CPU work slows the steps it overlaps alike, while a step that is slow for its own reason
    (the loop's evaluation, a new epoch's workers) is not the save's. Before, such a step counted
    whole: an evaluation of 60 s every 1000 steps, inside most 600-step writes, made every save cost
    a minute and saved 8 times too rarely."""
    rows, left = [], blocked
    for _t, x, n in busy:
        e = (x - base) * n
        take = min(max(e, 0.0), left)
        left -= take
        rows.append((e - take, n))
    total = sum(n for _e, n in rows)
    drop = int(TRIM * total)
    rows.sort(key=lambda r: r[0] / r[1], reverse=True)
    while rows and rows[0][1] <= drop:
        drop -= rows.pop(0)[1]
    kept = sum(n for _e, n in rows)
    return max(0.0, sum(e for e, _n in rows) / kept * total) if kept else 0.0


def _interval_lines(log_path: str | os.PathLike[str]) -> Iterator[bytes]:
    """``DalyInterval.seed_from_log``: the raw lines of the log at ``log_path`` that may be ``interval`` events,
    newest first, read back from its end ``RESUME_TAIL`` bytes at a time, at most ``RESUME_SCAN`` bytes (a line
    cut there is left out); none when it cannot be read (a new run: no log). Not the last ``RESUME_TAIL`` bytes
    alone (review56j): under ``trainguard run`` rank 0 logs a ``step`` event (~110 bytes) every step, so a
    restart more than ~9,500 steps after the last save found no seed, and every rank logs an ``interval``
    event per save (~450 bytes): at 2,048 ranks one save's fill the last MiB, rank 0's anywhere in it."""
    try:
        with open(log_path, "rb") as f:
            end = size = os.fstat(f.fileno()).st_size
            carry = b""  # the start of the line the later chunk began inside of
            while end > 0 and size - end < RESUME_SCAN:
                start = max(0, end - RESUME_TAIL)
                f.seek(start)
                lines = (f.read(end - start) + carry).split(b"\n")
                carry, end = (lines.pop(0) if start else b""), start
                yield from (raw for raw in reversed(lines) if _MARK in raw)
    except OSError:  # none yet (a new run), unreadable: measured as in a new run
        return


def _cost(v: object) -> float | None:
    """``DalyInterval.seed_from_log``: a logged cost in seconds as a float, None where it is none (absent, a
    bool, negative, NaN, infinite, an int too large for a float: a damaged line raised OverflowError)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if 0.0 <= x < math.inf else None


class DalyInterval(SavePolicy):
    """Save at Daly's optimal interval for the failure rate given and the save cost measured.

    ``tg.DalyInterval(node_failures_per_day=0.0065, nodes=256)`` (or ``node_mtbf_s=...``).
    Until the first save has been measured, saves every ``initial_steps`` steps. After each
    save the interval becomes ``daly_interval(stall + slowdown, job MTBF) / step_time`` steps,
    clamped to ``[min_steps, max_steps]``, and for a save that commits after training resumed
    (async) never shorter than one save's full duration (so a save never starts while the
    previous one is in flight; this floor wins over ``max_steps``); a sync save has no such floor.
    ``slowdown`` is the training time the steps that began while a save was being written took
    beyond the quiet steps' median (an async save's copy, checksum and write compete with
    training for the CPU; on a GPU it is near zero). Stall, slowdown, duration and step time are
    medians of the last ``window`` measurements. The first save this policy measures (its
    process's first: the staging buffer faulted in, the files created, a first round of
    ``trainguard bench``) sets the interval alone and is dropped when the second is measured:
    kept, it was half the median of two and set the second interval too (a 30 s first stall against
    1 s after: 1258 steps for an optimum of 322). A resumed run's new process takes the costs its
    run measured before from the event log (:meth:`seed_from_log`) and does not count its first.
    """

    needs_agreement = True

    def __init__(
        self,
        *,
        node_failures_per_day: float | None = None,
        nodes: int = 1,
        node_mtbf_s: float | None = None,
        initial_steps: SupportsIndex = 100,
        min_steps: SupportsIndex = 1,
        max_steps: SupportsIndex | None = None,
        window: SupportsIndex = 5,
    ) -> None:
        self.mtbf_s = job_mtbf(nodes=nodes, node_failures_per_day=node_failures_per_day, node_mtbf_s=node_mtbf_s)
        first, lo, win, hi = (whole(v) for v in (initial_steps, min_steps, window, max_steps))  # ints from here on
        for name, v in (("initial_steps", first), ("min_steps", lo), ("window", win)):
            if type(v) is not int or v < 1:  # a numpy int is one (errors.whole), a bool or 2.0 is not
                raise ValueError(f"DalyInterval({name}={v!r}): must be a positive integer")
        if hi is not None and (type(hi) is not int or hi < lo):
            raise ValueError(f"DalyInterval(max_steps={hi!r}): must be an integer >= min_steps={lo}")
        self.nodes = nodes
        self.min_steps: int = lo
        self.max_steps: int | None = hi
        self.interval_steps = self._clamp(first)
        self.next_step: int | None = None  # anchored at the first step seen (a resumed run starts late)
        self.reason = f"initial: {self.interval_steps} steps until a save has been measured"
        self.events: Any = None  # set by the manager: an EventLog or None
        # Set by trainguard's manager, which reports each save's duration up to its commit: a
        # measurement, never capped. Another caller that only notices a commit at its next save
        # leaves it False: its duration is then an upper bound (see on_saved).
        self.exact_durations = False
        self._stalls: deque[float] = deque(maxlen=win)
        self._durations: deque[float] = deque(maxlen=win)
        self._step_times: deque[float] = deque(maxlen=8 * win)
        self._slowdowns: deque[float] = deque(maxlen=win)
        self._quiet: deque[float] = deque(maxlen=8 * win)  # step times with no save in flight
        self._measured = 0  # saves reported to on_saved (the first one's costs count only until a second's)
        self._seeded = False  # the save costs came from an earlier process's event log (seed_from_log)
        # step -> (when should_save said yes to it, the step-time samples since: (start, s per step, steps))
        self._pending: dict[int, tuple[float, list[tuple[float, float, int]]]] = {}
        self._last: tuple[int, float] | None = None  # (step, now) of the previous on_step
        self._decided: int | None = None  # the last step should_save said yes to
        self._prev: int | None = None  # the step of the previous on_step (never reset by a save)

    # -- the SavePolicy protocol ---------------------------------------------------------
    def on_step(self, step: int, now: float) -> None:
        """Record the step time from consecutive calls; a sample spanning a save's stall is dropped.
        A step behind the previous one (a rollback, ``mgr.restore(state, step=N)`` mid-run) anchors
        ``next_step`` again at this step, as at a start: the old timeline's ``next_step`` would leave
        every step up to it unsaved."""
        if self._prev is not None and step < self._prev:
            self.next_step, self._decided, self._last = None, None, None
        self._prev = step
        if self._last is not None and step > self._last[0] and now >= self._last[1]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            if self._last[0] != self._decided:
                self._step_times.append(per_step)
                self._sample(self._last[1], per_step, step - self._last[0])
            elif self._decided in self._pending:  # it spans the save's call: its save's slowdown only
                self._pending[self._decided][1].append((self._last[1], per_step, step - self._last[0]))
        self._last = (step, now)
        self._anchor(step)

    def should_save(self, step: int, now: float) -> bool:
        """True once ``step`` reached ``next_step``: a function of the step only, equal on all ranks.

        Saying yes moves ``next_step`` on by the current interval at once, so that an async
        save whose ``on_saved`` comes later does not make every following step a save too.
        Asking twice for the same step gives the same answer.
        """
        self._anchor(step)
        assert self.next_step is not None
        if step == self._decided:
            return True
        if step < self.next_step:
            return False
        self._decided = step
        if len(self._pending) >= 16:  # decided, never reported (failed saves): the oldest forgotten
            del self._pending[min(self._pending)]
        self._pending[step] = (now, [])
        self.next_step = step + self.interval_steps  # provisional until on_saved
        return True

    def on_saved(self, step: int, stall_s: float, duration_s: float, *, waited_s: float = 0.0) -> None:
        """Record the save's stall and duration, then choose the next interval. ``waited_s``: the
        part of the save's call that waited for the previous save (trainguard's manager passes it;
        the stall and duration come without it), which is not the save's own slowdown either.

        A manager may notice that an async save finished only when it starts the next one;
        then ``duration_s`` spans the whole gap between the two saves and is only an upper
        bound, so it is capped at that gap (it must not ratchet the interval up). Not with
        ``exact_durations`` (trainguard's manager): a save that outlasted the gap did so, and
        capping it kept the interval below one save's duration, each save waiting for the last.
        A NaN or infinite value (a caller of its own) is a ValueError: a NaN stall was read as 0 s and
        saved at every step, an infinite duration raised OverflowError from the interval's floor.
        """
        for name, v in (("stall_s", stall_s), ("duration_s", duration_s), ("waited_s", waited_s)):
            if not math.isfinite(float(v)):  # NaN: max() kept 0 s, and Daly's 0 s saved at every step (review56j)
                raise ValueError(f"DalyInterval.on_saved(step={step}, {name}={v!r}): must be finite seconds; measure "
                                 "the save with time.monotonic() around it (a save not measured: do not report it)")
        stall, duration = max(0.0, float(stall_s)), max(float(stall_s), float(duration_s))
        step_time = self.measurements()["step_time_s"]
        if not self.exact_durations and self._decided is not None and self._decided > step and step_time:
            duration = min(duration, (self._decided - step) * step_time)
        slow = self._slowdown(step, stall, max(0.0, float(waited_s)), duration)
        if self._measured == 1 and not self._seeded:  # the second save measured: the first's one-off costs
            for d in (self._stalls, self._durations, self._slowdowns):  # (staging buffer faulted in, files
                d.clear()  # created) go
        if not (self._measured == 0 and self._seeded):  # with an earlier process's costs: the first not counted
            self._stalls.append(stall)
            self._durations.append(duration)
            self._slowdowns.append(slow)
        self._measured += 1
        if self._last is not None and self._last[0] == step != self._decided:  # a forced save at this step:
            self._last = None  # the next sample holds its stall (a decided one's: see on_step)
        self._choose(step, self.measurements())

    def seed_from_log(self, log_path: str | os.PathLike[str]) -> None:
        """``policies.attach`` (the manager's constructor and ``open``, rank 0: the others' decisions are not used), with the run
        directory's event log (file storage; an object store has none): a resumed run's new process
        takes the save costs (stall, slowdown, duration) of the last ``interval`` event rank 0 of an
        earlier process logged with measured values, as one measurement each. Its first save, which
        pays one-off costs (the staging buffer faulted in), then counts for nothing: before, every
        restart measured the costs anew from that save alone and saved too rarely until the next.
        The step time is measured anew (another node count, another batch). Nothing when this policy
        has measured a save already (an in-process restart keeps its own), or the log has no such event
        in its last ``RESUME_SCAN`` bytes (:func:`_interval_lines`). An event marked ``first_save`` (its process ended after one save:
        those costs are its one-off ones, which a process drops of its own) or with a cost that is no finite
        number is passed over for an earlier one (review56j: the first was a seed, kept beside the second
        save; the second raised OverflowError out of the manager's constructor)."""
        if self._measured or self._seeded or self._stalls:
            return
        for raw in _interval_lines(log_path):
            for ev in reversed([e for t in text_lines(raw) for e in parse_line(t)]):
                stall, duration, slow = (_cost(ev.get(k)) for k in ("stall_s", "duration_s", "slowdown_s"))
                slow = 0.0 if ev.get("slowdown_s") is None else slow  # absent from the events of a trainguard before it
                if (ev.get("event") != "interval" or ev.get("rank") != 0 or stall is None or duration is None
                        or slow is None or ev.get("first_save") is True):
                    continue  # first_save: that process's first save's one-off costs alone (_choose), not the run's
                self._stalls.append(stall)
                self._durations.append(max(stall, duration))
                self._slowdowns.append(slow)
                self._seeded = True
                self.reason += (f"; an earlier process of this run measured a save's stall {format_duration(stall)}, "
                                f"duration {format_duration(duration)}: the interval after the first save counts them")
                return

    def _sample(self, start: float, per_step: float, steps: int) -> None:
        """File a step-time sample: quiet when no save is decided and unreported, else kept with
        each such save (at most ``SAMPLES_PER_SAVE``), to be sorted out by :meth:`_slowdown`."""
        if not self._pending:
            self._quiet.append(per_step)
        for at, samples in self._pending.values():
            if start >= at and len(samples) < SAMPLES_PER_SAVE:
                samples.append((start, per_step, steps))

    def _slowdown(self, step: int, stall: float, waited: float, duration: float) -> float:
        """The training time that the steps which began while the save of ``step`` was in flight
        (from its decision until ``waited + duration`` later, the one spanning its call included)
        took beyond the quiet steps' median, less ``stall + waited`` (part of those steps: the
        call with its wait for the previous save, the pre-step waits). The steps after it, up to
        the next decision, are quiet ones. 0 without a decision (a forced save), for a sync save
        (reported before the next step), or without quiet steps to compare with."""
        at, samples = self._pending.pop(step, (None, []))
        for k in [k for k in self._pending if k < step]:  # decided before it, never reported (failed)
            del self._pending[k]
        if at is None:
            return 0.0
        end, nxt = at + waited + duration, min((a for a, _ in self._pending.values()), default=math.inf)
        self._quiet.extend(x for t, x, _n in samples if end <= t < nxt)
        if not self._quiet:
            return 0.0
        busy = sorted((t, x, n) for t, x, n in samples if t < end)
        return _excess(busy, statistics.median(self._quiet), stall + waited)

    # -- agreement across ranks ----------------------------------------------------------
    def measurements(self) -> dict[str, float | None]:
        """The smoothed values the interval is computed from. trainguard's manager does not call it (it
        broadcasts rank 0's decision every step); another caller may broadcast rank 0's and :meth:`agree`."""
        return {
            "stall_s": statistics.median(self._stalls) if self._stalls else None,
            "slowdown_s": statistics.median(self._slowdowns) if self._slowdowns else None,
            "duration_s": statistics.median(self._durations) if self._durations else None,
            # the quiet steps' (with no save in flight): a save's slower steps are in its cost already
            "step_time_s": statistics.median(self._quiet or self._step_times) if self._step_times else None,
        }

    def agree(self, step: int, values: dict[str, float | None]) -> None:
        """Recompute the interval after the save at ``step`` from ``values`` (rank 0's measurements)."""
        self._choose(step, values, emit=False)

    # -- internals -----------------------------------------------------------------------
    def _anchor(self, step: int) -> None:
        if self.next_step is None:
            self.next_step = step + self.interval_steps
            self._emit(step, rule="initial")

    def _clamp(self, steps: int) -> int:
        steps = max(self.min_steps, steps)
        return steps if self.max_steps is None else min(self.max_steps, steps)

    def _choose(self, step: int, m: dict[str, float | None], *, emit: bool = True) -> None:
        stall, duration, step_time = m.get("stall_s"), m.get("duration_s"), m.get("step_time_s")
        if stall is None or duration is None or not step_time:
            rule = "waiting"
            self.reason = f"waiting for step-time measurements; keeping {self.interval_steps} steps"
        else:
            slow = m.get("slowdown_s") or 0.0  # absent from the values of a caller that predates it
            tau = daly_interval(stall + slow, self.mtbf_s)
            daly_steps = max(1, round(tau / step_time))
            # one save in flight: only a save that commits after its stall (async) can overlap the next; a sync
            # save's duration is its stall, and a floor of it overrode Daly's M when the stall passed ~0.8 M
            floor_steps = max(1, math.ceil(duration / step_time)) if duration > stall else 0
            steps, rule = self._clamp(daly_steps), "daly"
            if steps != daly_steps:
                rule = "min_steps" if steps > daly_steps else "max_steps"
            cost = f"stall {format_duration(stall)}"
            if slow > 0:
                cost = f"save cost {format_duration(stall + slow)} ({cost} + {format_duration(slow)} of slower steps)"
            self.reason = (
                f"Daly: {cost}, job MTBF {format_duration(self.mtbf_s)} -> "
                f"save every {format_duration(tau)} of compute = {daly_steps} steps of {step_time:.3g}s"
            )
            if rule != "daly":
                self.reason += f"; clamped to {rule}={steps}"
            if floor_steps > steps:  # the floor wins even over max_steps: one save in flight at a time
                steps, rule = floor_steps, "save-duration"
                self.reason += f"; raised to {floor_steps} steps: one save takes {format_duration(duration)}"
            self.interval_steps = steps
        # counted from the newest save decided, which is later than ``step`` when on_saved came late
        self.next_step = max(step, self._decided or step) + self.interval_steps
        if emit:  # first_save: these medians are this process's first save alone, its one-off costs (seed_from_log)
            self._emit(step, rule=rule, **m, **({"first_save": True} if self._measured == 1 and not self._seeded else {}))

    def _emit(self, step: int, *, rule: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(
                "interval", step=step, steps=self.interval_steps, next_step=self.next_step,
                rule=rule, reason=self.reason, mtbf_s=self.mtbf_s, **fields,
            )

    def describe(self) -> str:
        return f"{self!r}: every {self.interval_steps} steps ({self.reason})"

    def __repr__(self) -> str:
        return f"DalyInterval(nodes={self.nodes}, job_mtbf={format_duration(self.mtbf_s)})"
