"""What ``trainguard report`` keeps of an event log while it reads it (:mod:`.report`).

:class:`Tally` takes the events one at a time, in the order of the log, and keeps only what the
summary is computed from: counts and sums, the time between consecutive steps (8 bytes a step, for
the exact median), the steps run as ranges per process, and the events of incidents (starts,
rendezvous, failures, restores, first steps: a few per restart). The report held every parsed
event before, ~1 kB each: 0.8 GB for a week's log at a step a second, 5 GB for four weeks of 64
ranks (``bench/event_log_scale.py``).

The summary is that of the events sorted by time (a stable sort: the log's order among equal
times). The log is in time order but for a little: lines of several processes, clocks of several
hosts. ``step`` and rank 0's ``save`` events, which make most of the log, pass through a window of
``window`` of them that puts them in time order; one earlier than one already taken out of it
raises :class:`Unordered` (:func:`report.tally_log` then reads the log again with no window,
keeping those events in memory). ``window=None``: all are kept until :meth:`Tally.finish`.

A clock set back (an NTP step) shows in the log's order as a ``step`` event (rank 0's heartbeat: one
process at a time) earlier than the previous one by more than ``SET_BACK_MIN``: :attr:`Tally.set_back` sums those steps back
(since session 51, between two steps of one process, from the difference between their ``mono`` fields, the
process's monotonic clock, and their ``t``: a step forward then takes back an earlier step back, which
otherwise looks like a pause and doubled the wall time of a run whose clock was set back and forward again),
and ``report.summary`` then takes the
final step from the log's order (:attr:`Tally.log_final`) and adds them to the wall time. Before,
the final step was the one logged latest by the clock: a run that ended before its clock caught up
again reported the step it was at when the clock was set back, and a wall time short by the step. Across a
restart (the last step of one process, the first of the next: no common ``mono``) the step back is counted as
the drop of ``t``, missing the restart's seconds; since session 52 the agent's events carry ``mono``, and
:class:`~trainguard.clockback.AgentBridge` adds those seconds where its events straddle that step back.
"""

from __future__ import annotations

import heapq
import statistics
from array import array
from bisect import bisect_right
from collections import deque
from operator import itemgetter
from typing import Any

from .clockback import AgentBridge
from .problems import KINDS as PROBLEM_KINDS
from .problems import Problems
from .saveends import ENDS_PROCESS, SaveEnds

WINDOW = 4096  # steps (and saves) held to put them in time order: an hour at a step a second
SET_BACK_MIN = 1.0  # seconds: a process's step going back by less changes a figure by less (chrony's makestep default)
_KEPT = {"failure", "fault", "hang", "first_step", "agent_start"}  # every one; restarts, restores, rendezvous: some
_I64 = 1 << 63


class Unordered(Exception):
    """A ``step`` or rank 0's ``save`` older than one the window already let out (a clock set back)."""


class StepRuns:
    """The distinct (pid, step) pairs of ``step`` events, counted: per pid, ranges of consecutive
    int steps (one per process normally), other steps in a set."""

    def __init__(self) -> None:
        self.count = 0
        self._runs: dict[Any, tuple[array, array]] = {}  # pid -> (starts, ends), sorted, disjoint, not adjacent
        self._other: set[tuple[Any, Any]] = set()

    def add(self, pid: Any, step: Any) -> None:
        r = self._runs.get(pid)
        if r is not None and type(step) is int and step == r[1][-1] + 1 and step < _I64:  # the next step of a process
            r[1][-1] = step
            self.count += 1
            return
        if isinstance(step, float) and step.is_integer():
            step = int(step)  # 3.0 == 3: one pair, as in a set
        if not isinstance(step, int) or not -_I64 < step < _I64 - 1:
            if (pid, step) not in self._other:
                self._other.add((pid, step))
                self.count += 1
            return
        step = int(step)  # True == 1
        if r is None:
            self._runs[pid] = (array("q", [step]), array("q", [step]))
            self.count += 1
            return
        starts, ends = r
        if step == ends[-1] + 1:
            ends[-1] = step
        elif starts[-1] <= step <= ends[-1]:
            return
        elif step > ends[-1]:
            starts.append(step)
            ends.append(step)
        else:
            i = bisect_right(starts, step) - 1
            if i >= 0 and step <= ends[i]:
                return
            left, right = i >= 0 and ends[i] == step - 1, starts[i + 1] == step + 1
            if left and right:
                ends[i] = ends[i + 1]
                del starts[i + 1], ends[i + 1]
            elif left:
                ends[i] = step
            elif right:
                starts[i + 1] = step
            else:
                starts.insert(i + 1, step)
                ends.insert(i + 1, step)
        self.count += 1


class _Window:
    """Items ``(key, seq, ...)`` that arrive nearly in key order, let out (``take(*item)``) in key order,
    those of one key in arrival order (``seq``), once more than ``size`` are held; ``size=None``: all
    held until :meth:`drain`. In order, a deque; from the first item out of order on, a heap."""

    def __init__(self, size: int | None, take: Any) -> None:
        self.size, self.take = size, take
        self.items: Any = deque() if size is not None else []
        self.heap = False
        self.floor: Any = None  # key of the last item let out

    def put(self, item: tuple[Any, ...]) -> None:
        items = self.items
        if self.size is None:
            items.append(item)
        elif self.heap:
            if self.floor is not None and item[0] < self.floor:
                raise Unordered(f"an event at t={item[0]} after one at t={self.floor}, {self.size} lines earlier")
            if len(items) < self.size:
                heapq.heappush(items, item)
                return
            out = heapq.heappushpop(items, item)
            self.floor = out[0]
            self.take(*out)
        elif items and item[0] < items[-1][0]:  # the first out of order: a heap from now on (a sorted list is one)
            self.items, self.heap = list(items), True
            self.put(item)
        else:
            items.append(item)
            if len(items) > self.size:
                out = items.popleft()
                self.floor = out[0]
                self.take(*out)

    def drain(self) -> None:
        items = self.items
        if self.size is None:
            items.sort(key=itemgetter(0))  # stable: those of one key in arrival order
            for item in items:
                self.take(*item)
        elif self.heap:
            while items:
                self.take(*heapq.heappop(items))
        else:
            while items:
                self.take(*items.popleft())
        self.items = deque() if self.size is not None else []


class Tally:
    """The summary's inputs, gathered in one pass over the events (see the module docstring).

    ``report.summarize`` feeds it dicts (:meth:`add`), ``report.tally_log`` the lines of a log
    (``eventscan.feed``: :meth:`step` and :meth:`save` for the lines of those two kinds it read
    without ``json``); then :meth:`finish`, once. ``timeline=True`` also keeps what
    ``report.plot_timeline`` draws: the time and step of every step, per process (16 bytes a step)."""

    def __init__(self, window: int | None = WINDOW, *, timeline: bool = False) -> None:
        self.window = window
        self.events = 0
        self.first: Any = None  # t of the first event in time order (the first line of the least t), and of the last
        self.last: Any = None
        self.kept: list[tuple[Any, int, dict[str, Any]]] = []  # (key, seq, event): incidents
        self._steps = _Window(window, self._take_step)  # (t, seq, pid, step)
        self._saves = _Window(window, self._take_save)  # (t, seq, stall, duration, bytes)
        self.runs = StepRuns()
        self.dts: Any = array("d")  # b.t - a.t of consecutive steps of one process (a list if one is no float)
        self._prev: Any = None  # (pid, step, t) of the last step let out
        self.final: Any = None
        self.saves = 0
        self.stall: Any = 0
        self.durations: list[Any] = []
        self.save_bytes: Any = None
        self.points: dict[Any, tuple[Any, Any]] | None = {} if timeline else None  # pid -> (ts, steps), log order
        self.save_points: list[tuple[Any, Any]] = []  # rank 0's (committed_t, step), with timeline
        self.saved_steps: set[Any] = set()  # steps of rank 0's save events (report: restores of others)
        self.tail: Any = None  # t of the last event fed (the log's last line)
        self.log_final: Any = None  # step of the last step event fed (the log's order)
        self.set_back: Any = 0  # seconds a process's clock went back between two of its step events (net)
        self.went_back = self.went_forward = False  # a step back counted, a step forward measured (mono): report.summary
        self._step_t: Any = None  # t of the last step event fed
        self._step_mono: Any = None  # and its process's monotonic clock (``mono``; logs before session 51: none)
        self._step_pid: Any = None  # and its pid
        self.save_ends = SaveEnds()  # rank 0's saves begun and not ended, failed (saveends.py)
        self.bridge = AgentBridge()  # the agent's mono across a restart (clockback.py)
        self._step_seq: Any = None  # seq of the last step event fed
        self.problems = Problems()  # restore_skip, retention_damaged, store_lost...: deduplicated (problems.py)

    def _seen(self, key: Any) -> int:
        """Counts an event at time ``key`` (its ``t``); its place in the log."""
        seq = self.events
        self.events = seq + 1
        if self.first is None or key < self.first:
            self.first = key
        if self.last is None or key >= self.last:
            self.last = key
        self.tail = key
        return seq

    def add(self, e: dict[str, Any]) -> None:
        """One event (a dict of the log)."""
        key = e.get("t", 0.0)
        seq = self._seen(key)
        kind = e["event"]
        if e.get("rank") == -1 and e.get("mono") is not None:  # the agent's, since session 52 (clockback.py)
            self.bridge.agent(seq, e)
        if kind == "step":
            self.step(key, seq, e.get("pid"), e["step"], e.get("mono"))
        elif kind == "save":
            if e.get("rank") == 0:
                stall, duration, committed = (e.get(k) for k in ("stall_s", "duration_s", "committed_t"))
                self.save(key, seq, 0.0 if stall is None else stall, 0.0 if duration is None else duration,
                          e.get("bytes"), key if committed is None else committed, e.get("step"), e.get("pid"))
        elif kind in ("save_start", "save_failed") and e.get("rank") == 0:
            if kind == "save_start":
                self.save_ends.start(key, e.get("pid"), e.get("step"))
            else:
                self.save_ends.failed_save(key, e.get("pid"), e.get("step"), e.get("error"))
        elif kind == "save_retention":  # a sync save's retention after its commit (saveevent.retention_waited)
            if e.get("rank") == 0 and e.get("stall_s") is not None:
                self.stall += e["stall_s"]
        else:
            if kind in PROBLEM_KINDS:
                self.problems.add(e)
            if kind == "agent_start":  # a job (re)started: its rank 0 is a new process even with the last one's pid (a
                self._step_pid = None  # requeued container on another host): its mono is not compared with that one's
            if kind in ENDS_PROCESS or (kind in ("restore", "fresh_start", "manager_open") and e.get("rank") == 0):
                self.save_ends.process_ended(e.get("pid") if kind in ("restore", "fresh_start") else None)  # saveends.py
            if (kind in _KEPT or (kind in ("restore", "fresh_start") and e.get("rank") == 0)
                    or (kind == "restart" and e.get("reason") == "membership")
                    or (kind == "rendezvous" and e.get("node_rank", 0) == 0)):
                self.kept.append((key, seq, e))

    def step(self, key: Any, seq: int, pid: Any, step: Any, mono: Any = None) -> None:
        """A ``step`` event at time ``key`` (its ``t``; ``seq``: its place in the log, from :meth:`_seen`;
        ``mono``: its process's ``time.monotonic()``, where the event has one)."""
        self.runs.add(pid, step)
        prev = self._step_t
        if prev is not None and mono is not None and self._step_mono is not None and pid == self._step_pid:
            # One process's two steps: its monotonic clock, which no NTP step moves, timed the gap, so
            # the wall clock's step either way is known; a step forward takes back an earlier step back.
            back = (mono - self._step_mono) - (key - prev)
            if abs(back) > SET_BACK_MIN:
                self.set_back += back
                self.went_forward, self.went_back = self.went_forward or back < 0, self.went_back or back > 0
                self.bridge.step_back(self._step_seq, seq, back, False)
        elif prev is not None and key < prev - SET_BACK_MIN:  # the clock went back (an NTP step), in the log's order
            self.set_back += prev - key  # as if no time passed between the two: a restart's seconds are missed
            self.went_back = True
            self.bridge.step_back(self._step_seq, seq, prev - key, True)
        elif prev is not None and pid != self._step_pid:  # another process's, t not back: a step forward unknown
            self.bridge.crossing(self._step_seq, seq)
        self._step_t, self._step_mono, self._step_pid, self._step_seq = key, mono, pid, seq
        self.log_final = step
        if self.points is not None:
            self._point(pid, key, step)
        self._steps.put((key, seq, pid, step))

    def step_line(self, t: float, pid: int, step: int, mono: float | None = None) -> None:
        """:meth:`_seen` and :meth:`step` in one call (``eventscan.feed``'s lines read without json)."""
        self.step(t, self._seen(t), pid, step, mono)

    def _take_step(self, t: Any, _seq: int, pid: Any, step: Any) -> None:
        p = self._prev
        if p is not None and p[0] == pid and step == p[1] + 1:
            d = t - p[2]
            if type(d) is not float and type(self.dts) is array:
                self.dts = list(self.dts)
            self.dts.append(d)
        self._prev = (pid, step, t)
        self.final = step

    def save(self, key: Any, seq: int, stall: Any, duration: Any, nbytes: Any, committed: Any, step: Any,
             pid: Any = None) -> None:
        """Rank 0's ``save`` event (of process ``pid``)."""
        self.save_ends.ended(pid, step)
        if self.points is not None:
            self.save_points.append((committed, step))
        self.saved_steps.add(step)
        self._saves.put((key, seq, stall, duration, nbytes))

    def _take_save(self, _t: Any, _seq: int, stall: Any, duration: Any, nbytes: Any) -> None:
        self.saves += 1
        self.stall += stall
        self.durations.append(duration)
        self.save_bytes = nbytes

    def _point(self, pid: Any, t: Any, step: Any) -> None:
        assert self.points is not None
        pts = self.points.get(pid)
        if pts is None:
            pts = self.points[pid] = (array("d"), array("q"))
        if type(pts[1]) is array and not (type(step) is int and -_I64 <= step < _I64 and type(t) in (int, float)):
            pts = self.points[pid] = (list(pts[0]), list(pts[1]))
        pts[0].append(t)
        pts[1].append(step)

    def finish(self) -> Tally:
        """Every step and save out of the window, in time order; the kept events stay in the order fed (the log's)."""
        self._steps.drain()
        self._saves.drain()
        if self.set_back and (missed := self.bridge.correction()):  # a restart's seconds across a step back (clockback.py)
            self.set_back += missed
            self.went_forward = self.went_forward or missed < 0
        return self

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        """The kept events of ``kinds``, in the order fed (the log's)."""
        return [e for _k, _s, e in self.kept if e["event"] in kinds]

    def at(self, *kinds: str) -> list[tuple[int, dict[str, Any]]]:
        """``(seq, event)`` of the kept events of ``kinds``, in the order fed: ``seq`` their place in it."""
        return [(q, e) for _k, q, e in self.kept if e["event"] in kinds]

    def median_step(self) -> Any:
        """``statistics.median`` of the step times, without a float object each: numpy's partition, in
        place (called once, by ``report.summary``: the times are left out of order)."""
        if type(self.dts) is not array:
            return statistics.median(self.dts) if self.dts else None
        n = len(self.dts)
        if not n:
            return None
        import numpy as np

        x, i = np.frombuffer(self.dts, dtype=np.float64), n // 2
        if n % 2:
            x.partition(i)
            return float(x[i])
        x.partition((i - 1, i))
        return (float(x[i - 1]) + float(x[i])) / 2
