"""A wall clock set back during a restart, measured by the agent's monotonic clock (``trainguard report``).

:class:`~trainguard.tally.Tally` sums the seconds the wall clock went back (``set_back``) from rank 0's
``step`` events in the log's order: between two steps of one process from their ``mono`` fields (exact);
between the last step of one process and the first of the next (a restart: new processes, whose
monotonic clocks the report does not compare) only as the drop of ``t``, as if no time had passed. A
clock set back 3,600 s during a restart of 4 s was counted as 3,596 s back, and the report's wall time
missed those 4 s (40 s for 44).

The agent is one process across restarts: since session 52 its events carry ``mono`` too
(``EventLog(mono=True)`` in ``launcher.main``), and between two of them the clock went back by exactly
``(mono_b - mono_a) - (t_b - t_a)``. :class:`AgentBridge` replaces the step estimate by it where that
is sound: the agent's two consecutive events (one process) straddle exactly one step pair that was
estimated (``t`` dropped, no ``mono`` to compare), and the agent's exact figure exceeds what the step
pairs within its interval counted (the seconds of the restart the estimate missed). Where an agent
interval holds several estimated pairs, or the agent's figure is not above the steps', the estimate
stands; and in a log of several nodes (a ``rendezvous`` of ``nodes`` > 1: agents on other hosts, whose
clocks are not rank 0's and whose pids, in containers, may be the same) it always does. A clock set forward
during a restart (the agent's figure below 0, no step pair counted in its interval, one pair of two processes whose
``t`` did not go back: :meth:`AgentBridge.crossing`) is taken from the steps' set-back (since review52c), as a step
forward between two steps of one process is: set back 3,600 s in one restart and forward in the next, a job of 43 s
was reported as 3,643 s. Logs whose agent events carry no ``mono`` (before session 52) report as before.

Called by :class:`~trainguard.tally.Tally` only: :meth:`AgentBridge.agent` for each agent event with
``mono``, :meth:`AgentBridge.step_back` for each step pair it counts as set back, :meth:`AgentBridge.crossing`
for each other step pair of two processes, :meth:`AgentBridge.correction`
once, at :meth:`~trainguard.tally.Tally.finish`.
"""

from __future__ import annotations

from typing import Any

SET_BACK_MIN = 1.0  # seconds: tally.SET_BACK_MIN (the same threshold)


class AgentBridge:
    """The set-backs the agent measured, and those the step events counted, by their places in the log."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[int, float, float]] = {}  # agent pid -> (seq, t, mono) of its last event
        self.agent_backs: list[tuple[int, int, float]] = []  # (seq a, seq b, seconds back) of an agent's event pair
        self.step_backs: list[tuple[int, int, float, bool]] = []  # (seq a, seq b, seconds, estimated) of step pairs
        self.several = False  # a rendezvous of several nodes: no correction
        self.crossings: list[tuple[int, int]] = []  # (seq a, seq b) of step pairs of two processes whose t did not go back

    def agent(self, seq: int, e: dict[str, Any]) -> None:
        """An agent's event ``e`` (rank -1) with ``mono``, at ``seq`` in the log. Paired with the previous event
        of its pid, not across an ``agent_start`` (a new agent: a pid of another host's, in a container, may be
        the same). None at all once a rendezvous counted several nodes: agents of several hosts, whose pids may
        be the same, and whose clocks are not rank 0's."""
        t, mono, pid = e.get("t"), e.get("mono"), e.get("pid")
        if e.get("event") == "rendezvous" and isinstance(e.get("nodes"), int) and e["nodes"] > 1:
            self.several = True
        if self.several or not (isinstance(t, (int, float)) and isinstance(mono, (int, float))):
            return
        prev = None if e.get("event") == "agent_start" else self._last.get(pid)
        self._last[pid] = (seq, t, mono)
        if prev is not None:
            back = (mono - prev[2]) - (t - prev[1])
            if abs(back) > SET_BACK_MIN:
                self.agent_backs.append((prev[0], seq, back))

    def step_back(self, seq_a: int, seq_b: int, seconds: float, estimated: bool) -> None:
        """A step pair the tally counted as a clock step of ``seconds`` (``estimated``: from ``t`` alone)."""
        self.step_backs.append((seq_a, seq_b, seconds, estimated))

    def crossing(self, seq_a: int, seq_b: int) -> None:
        """A step pair of two processes (a restart) whose ``t`` did not go back: not counted, a step forward in it unknown."""
        self.crossings.append((seq_a, seq_b))

    def correction(self) -> float:
        """The seconds to add to the steps' ``set_back``: for each agent interval that straddles exactly one
        estimated step pair, the agent's figure less what the step pairs within it counted, when above 0."""
        total, used = 0.0, set()
        if self.several:
            return total
        for a, b, back in self.agent_backs:
            inside = [x for x in self.step_backs if x[0] < b and a < x[1]]  # pairs overlapping the interval
            guessed = [x for x in inside if x[3]]
            if len(guessed) != 1 or guessed[0] in used:
                continue
            missed = back - sum(x[2] for x in inside)
            if missed > 0:  # the seconds between the estimated pair's two steps (the restart), which t did not show
                total += missed
                used.add(guessed[0])
        for a, b, back in self.agent_backs:  # a clock set forward during a restart: it takes back a step back counted
            if back < -SET_BACK_MIN and not any(x[0] < b and a < x[1] for x in self.step_backs):
                if sum(1 for x in self.crossings if x[0] < b and a < x[1]) == 1:  # one restart's pair, nothing else
                    total += back
        return total
