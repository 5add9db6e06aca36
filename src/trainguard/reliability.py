"""How often to save: failure probability, Young/Daly intervals, efficiency, Monte Carlo check.

Pure arithmetic on floats and numpy arrays; no torch, no I/O. Called by ``trainguard plan``
(:mod:`trainguard.commands.plan`), by :class:`trainguard.daly.DalyInterval` on every save, and by
the doctor's interval check. All times are seconds.

The model (Young 1974; Daly 2006): failures of the job form a Poisson process with mean time
between failures ``M = node_mtbf / nodes``. Training alternates ``tau`` seconds of useful compute
with a checkpoint that blocks training for ``delta`` seconds (the *stall*: for an async save only
its blocking part). A failure loses all work since the last committed checkpoint (including a
checkpoint being written), then costs ``R`` seconds to restart, during which failures can happen
too. Which formula gives which number (see docs/planning.md):

- :func:`young_interval`: ``sqrt(2 delta M)`` (Young 1974, first order);
- :func:`daly_interval`: Daly's 2006 higher-order estimate
  ``sqrt(2 delta M) [1 + sqrt(delta/2M)/3 + (delta/2M)/9] - delta`` (``M`` if ``delta >= 2M``);
- :func:`expected_wall_time`: the *exact* expected wall time of one ``tau`` of useful work in this
  model, ``M e^{R/M} (e^{(tau+delta)/M} - 1)`` (Daly 2006), hence :func:`efficiency` = ``tau / that``;
- :func:`optimal_interval`: the exact minimiser of that expression, found numerically;
- :func:`simulate`: a Monte Carlo run of the same model, to check the closed forms.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .durations import DAY, WEEK, format_duration, parse_duration  # noqa: F401  (imported from here too)


def job_mtbf(*, nodes: int, node_failures_per_day: float | None = None, node_mtbf_s: float | None = None) -> float:
    """The job's mean time between failures in seconds: a node's MTBF divided by the node count.

    Give exactly one of ``node_failures_per_day`` (failures per node per day) and ``node_mtbf_s``.
    """
    if (node_failures_per_day is None) == (node_mtbf_s is None):
        raise ValueError("give exactly one of node_failures_per_day and node_mtbf_s")
    if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral) or nodes < 1:
        raise ValueError(f"nodes={nodes!r}: the node count must be a positive integer (nodes, not GPUs)")
    if node_mtbf_s is None:
        f = node_failures_per_day
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f < math.inf:
            raise ValueError(f"node_failures_per_day={node_failures_per_day!r} must be a finite number > 0")
        node_mtbf_s = DAY / node_failures_per_day
        if node_mtbf_s == math.inf:  # 1e-320 failures a day: a node MTBF past a float
            raise ValueError(f"node_failures_per_day={node_failures_per_day!r} is too small: a node would never fail")
    _need("node_mtbf_s", node_mtbf_s, "a node's mean time between failures", zero=False)
    m = float(float(node_mtbf_s) / nodes) if nodes < 1e300 else 0.0  # 10**400 nodes: an OverflowError
    if not m > 0:
        raise ValueError(f"nodes={nodes if nodes < 1e300 else f'10^{len(str(nodes)) - 1}'}: the job MTBF "
                         "(node MTBF / nodes) is too small to compute with")
    return m


def _need(name: str, v: Any, what: str, *, zero: bool = True, finite: bool = True) -> None:
    """A ValueError naming ``v`` unless a real number (not a bool or a string) >= 0 (> 0 without ``zero``), finite
    unless ``finite`` is False."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (v >= 0 if zero else v > 0) or (finite and v == math.inf):
        hint = " (a number, not a string: parse_duration('30s') reads one)" if isinstance(v, str) else ""
        raise ValueError(f"{name}={v!r}: {what} must be {'finite ' * finite}seconds {'>=' if zero else '>'} 0{hint}")


def _check(mtbf_s: float, stall_s: float = 0.0, restart_s: float = 0.0) -> None:
    """The public formulas' inputs: a job MTBF > 0, a stall and a restart >= 0, all finite seconds."""
    _need("mtbf_s", mtbf_s, "the job's mean time between failures", zero=False)
    _need("stall_s", stall_s, "the time a save blocks training")
    _need("restart_s", restart_s, "the time from a failure until training runs again")


def p_failure(period_s: float, mtbf_s: float) -> float:
    """Probability of at least one failure of the job within ``period_s`` (exponential failures)."""
    _check(mtbf_s)
    _need("period_s", period_s, "the time to give the odds for", finite=False)
    return -math.expm1(-period_s / mtbf_s)


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum: compute time between saves ``sqrt(2 delta M)``."""
    _check(mtbf_s, stall_s)
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order estimate of the optimal compute time between saves."""
    _check(mtbf_s, stall_s)
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def expected_wall_time(interval_s: Any, stall_s: float, restart_s: float, mtbf_s: float) -> Any:
    """Exact expected wall time to commit one ``interval_s`` of useful work: ``M e^{R/M}(e^{(tau+delta)/M}-1)``.

    Works on floats and on numpy arrays of intervals.
    """
    _check(mtbf_s, stall_s, restart_s)
    tau = np.asarray(interval_s, dtype=float) if not isinstance(interval_s, (str, bool)) else np.nan
    if not np.all((tau >= 0) & (tau < math.inf)):  # a negative one gave an efficiency above 1, nan a nan
        raise ValueError(f"interval_s={interval_s!r}: the compute time between saves must be finite seconds >= 0")
    with np.errstate(over="ignore"):  # e^(huge) is inf: the job never gets through (efficiency 0)
        return mtbf_s * np.exp(restart_s / mtbf_s) * np.expm1((tau + stall_s) / mtbf_s)


def efficiency(interval_s: Any, stall_s: float, restart_s: float, mtbf_s: float) -> Any:
    """Useful time / wall time in the long run when saving after every ``interval_s`` of compute."""
    wall = expected_wall_time(interval_s, stall_s, restart_s, mtbf_s)  # checks the inputs
    out = np.asarray(interval_s, dtype=float) / wall
    return float(out) if out.ndim == 0 else out


def optimal_interval(stall_s: float, mtbf_s: float) -> float:
    """The exact optimum of :func:`efficiency` (independent of the restart cost).

    Solves ``e^{(tau+delta)/M} (tau/M - 1) + 1 = 0`` (the derivative's zero) by bisection, in the
    form ``tau/M - 1 + e^{-(tau+delta)/M} = 0`` (same sign, no overflow when ``delta >> M``), whose
    left side rises monotonically from below 0 at ``tau=0`` to above 0 at ``tau=M``.
    """
    _check(mtbf_s, stall_s)
    lo, hi = 0.0, mtbf_s
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        h = mid / mtbf_s + math.expm1(-(mid + stall_s) / mtbf_s)
        lo, hi = (mid, hi) if h < 0 else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured over all runs together."""

    efficiency: float  # total useful time / total wall time
    stderr: float  # standard error of ``efficiency`` (delta method over runs)
    failures_per_run: float
    wall_s_per_run: float


def simulate(
    *,
    interval_s: float,
    stall_s: float,
    restart_s: float,
    mtbf_s: float,
    work_s: float | None = None,
    runs: int = 2000,
    seed: int = 0,
) -> SimResult:
    """Monte Carlo estimate of :func:`efficiency`: ``runs`` independent jobs, each doing ``work_s``.

    Each job walks a timeline: a restart (after a failure) needs ``restart_s`` uninterrupted
    seconds, then segments of ``interval_s`` compute + ``stall_s`` save follow; a segment counts
    once its save finished. The time to the next failure is drawn from an exponential with mean
    ``mtbf_s`` (memoryless, so redrawn after each failure); a failure throws away the segment in
    progress. Vectorised over jobs: one numpy pass per failure, so the loop runs about
    ``max failures per job`` times. ``work_s`` defaults to 50 MTBFs.
    """
    _need("interval_s", interval_s, "the compute time between saves", zero=False)
    _check(mtbf_s, stall_s, restart_s)  # an infinite stall or restart looped forever
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1 or (work_s is not None and not work_s > 0):
        raise ValueError(f"runs={runs!r}, work_s={work_s!r}: runs must be an int >= 1, work_s a number > 0 (or None)")
    n_seg = max(1, math.ceil((50.0 * mtbf_s if work_s is None else work_s) / interval_s))
    # one numpy pass per failure: E[failures per interval] = T(tau) / M. A hopeless case (a stall of
    # 10 MTBFs: e^10 failures an interval) ran for hours; its efficiency is ~0 and efficiency() says so
    fails_run = n_seg * float(expected_wall_time(interval_s, stall_s, restart_s, mtbf_s)) / mtbf_s
    if not (fails_run <= 1e5 and fails_run * runs <= 1e8):
        raise ValueError(f"simulate: about {fails_run:.3g} failures a run x {runs} runs are too many to walk (1e5 a run, "
                         f"1e8 in all); efficiency() gives it exactly, {efficiency(interval_s, stall_s, restart_s, mtbf_s):.3g}: "
                         "give a smaller work_s or fewer runs, or a case with fewer failures")
    rng = np.random.default_rng(seed)
    seg = interval_s + stall_s
    remaining = np.full(runs, n_seg, dtype=np.int64)
    wall = np.zeros(runs)
    fails = np.zeros(runs, dtype=np.int64)
    restarting = np.zeros(runs, dtype=bool)
    active = np.arange(runs)
    while active.size:
        x = rng.exponential(mtbf_s, size=active.size)  # time until the next failure
        need_restart = np.where(restarting[active], restart_s, 0.0)
        avail = x - need_restart  # < 0: the failure hit the restart itself
        rem = remaining[active]
        finished = avail >= rem * seg
        done = np.where(avail > 0, np.floor(np.maximum(avail, 0.0) / seg), 0).astype(np.int64)
        wall[active] += np.where(finished, need_restart + rem * seg, x)
        remaining[active] = np.where(finished, 0, rem - np.minimum(done, rem))
        fails[active] += ~finished
        restarting[active] = ~finished
        active = active[~finished]
    useful = n_seg * interval_s
    eff = runs * useful / wall.sum()
    stderr = eff * wall.std(ddof=1) / wall.mean() / math.sqrt(runs) if runs > 1 else float("nan")
    return SimResult(eff, float(stderr), float(fails.mean()), float(wall.mean()))


@dataclass(frozen=True)
class IntervalRow:
    """Efficiency and cost of one candidate save interval."""

    label: str
    interval_s: float
    steps: int | None
    efficiency: float
    lost_gpu_hours_per_day: float


@dataclass(frozen=True)
class Plan:
    """Every figure ``trainguard plan`` prints; built by :func:`make_plan`."""

    nodes: int
    gpus_per_node: int
    node_mtbf_s: float
    stall_s: float
    restart_s: float
    step_time_s: float | None
    p_failure_day: float
    p_failure_week: float
    job_mtbf_s: float
    young_interval_s: float
    daly_interval_s: float
    optimal_interval_s: float
    efficiency_at_young: float
    efficiency_at_daly: float
    efficiency_at_optimum: float
    lost_gpu_hours_per_day: float
    rows: list[IntervalRow] = field(default_factory=list)
    # async saves: time from the end of the stall to the commit (save duration - stall). A failure
    # before the commit rolls back one more interval; exactly, it adds to the restart (see make_plan)
    commit_delay_s: float = 0.0

    def steps(self, seconds: float) -> int | None:
        """Compute time in training steps (at least 1), or None without a step time."""
        return None if self.step_time_s is None else max(1, round(seconds / self.step_time_s))

    def efficiency(self, interval_s: Any) -> Any:
        """:func:`efficiency` of this plan: a float for a float, an array for an array (``plot``'s curve)."""
        return efficiency(interval_s, self.stall_s, self.restart_s + self.commit_delay_s, self.job_mtbf_s)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``trainguard plan --json`` (floats rounded to 6 significant digits)."""
        d: dict[str, Any] = {k: v for k, v in asdict(self).items() if k != "rows"}
        d["job_mtbf_hours"] = self.job_mtbf_s / 3600.0
        d["young_interval_steps"] = self.steps(self.young_interval_s)
        d["daly_interval_steps"] = self.steps(self.daly_interval_s)
        d["intervals"] = [asdict(r) for r in self.rows]
        return _rounded(d)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def make_plan(
    *,
    nodes: int,
    stall_s: float,
    restart_s: float,
    node_failures_per_day: float | None = None,
    node_mtbf_s: float | None = None,
    step_time_s: float | None = None,
    gpus_per_node: int = 8,
    intervals: dict[str, float] | None = None,
    save_duration_s: float | None = None,
) -> Plan:
    """All planner figures. ``intervals`` maps a label (e.g. ``"500 steps"``) to compute seconds.

    ``save_duration_s``: an async save's whole duration, from the call to the commit (``trainguard
    report``'s "duration"); ``None`` (a sync save) is the stall. Its commit delay ``W = duration -
    stall`` counts exactly as restart time: with ``W <= tau`` (one save in flight), one interval's
    expected wall time is ``M e^{(R+W)/M} (e^{(tau+delta)/M} - 1)`` (a failure before the commit
    rolls back to the previous checkpoint and needs ``tau + delta + W`` uninterrupted to commit
    again), so the optimum is unchanged and every efficiency is ``e^{-W/M}`` lower.

    Called by ``trainguard plan`` and by users who pass ``plan=`` to :func:`trainguard.doctor`.
    """
    for name, v in (("stall_s", stall_s), ("restart_s", restart_s), ("step_time_s", step_time_s), ("save_duration_s", save_duration_s)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):  # "30s" raised a TypeError
            raise ValueError(f"{name}={v!r}: must be a number of seconds{' (parse_duration reads a string)' * isinstance(v, str)}")
    if not 0 < stall_s < math.inf:
        raise ValueError(
            f"stall_s={stall_s!r}: the time a save blocks training must be a finite number > 0 "
            "(with no cost, the optimum is to save continuously: no interval to plan)"
        )
    if not 0 <= restart_s < math.inf:
        raise ValueError(f"restart_s={restart_s!r}: the restart time must be a finite number >= 0")
    if step_time_s is not None and not 0 < step_time_s < math.inf:  # inf counted every interval as 1 step
        raise ValueError(f"step_time_s={step_time_s!r} must be finite seconds > 0")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 0:  # 0: CPU nodes (losthours.py)
        raise ValueError(f"gpus_per_node={gpus_per_node!r}: the GPUs per node must be an integer >= 0 (e.g. 8; 0: no GPUs)")
    if intervals is not None and (not isinstance(intervals, Mapping) or not all(0 < v < math.inf for v in intervals.values())):
        raise ValueError(f"intervals={intervals!r}: map labels to compute seconds > 0, e.g. {{'500 steps': 1000.0}}")
    if save_duration_s is not None and not stall_s <= save_duration_s < math.inf:
        raise ValueError(f"save_duration_s={save_duration_s!r}: an async save's whole duration (call to commit) must "
                         f"be finite seconds >= the stall ({format_duration(stall_s)})")
    commit_delay = 0.0 if save_duration_s is None else float(save_duration_s) - stall_s
    m = job_mtbf(nodes=nodes, node_failures_per_day=node_failures_per_day, node_mtbf_s=node_mtbf_s)
    restart_s, user_restart = restart_s + commit_delay, restart_s  # the efficiencies below count the delay
    young, daly, opt = young_interval(stall_s, m), daly_interval(stall_s, m), optimal_interval(stall_s, m)
    gpus = nodes * gpus_per_node
    longest = max([young, daly, opt, *(intervals or {}).values()])
    if step_time_s is not None and not math.isfinite(longest / step_time_s):  # Plan.steps would overflow
        raise ValueError(f"step_time_s={step_time_s!r}: too short to count {format_duration(longest)} of compute in steps")

    def row(label: str, tau: float) -> IntervalRow:
        e = efficiency(tau, stall_s, restart_s, m)
        steps = None if step_time_s is None else max(1, round(tau / step_time_s))
        return IntervalRow(label, tau, steps, e, (1.0 - e) * gpus * 24.0)

    e_daly = efficiency(daly, stall_s, restart_s, m)
    return Plan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        node_mtbf_s=m * nodes,
        stall_s=stall_s,
        restart_s=user_restart,
        step_time_s=step_time_s,
        p_failure_day=p_failure(DAY, m),
        p_failure_week=p_failure(WEEK, m),
        job_mtbf_s=m,
        young_interval_s=young,
        daly_interval_s=daly,
        optimal_interval_s=opt,
        efficiency_at_young=efficiency(young, stall_s, restart_s, m),
        efficiency_at_daly=e_daly,
        efficiency_at_optimum=efficiency(opt, stall_s, restart_s, m),
        lost_gpu_hours_per_day=(1.0 - e_daly) * gpus * 24.0,
        rows=[row(k, v) for k, v in (intervals or {}).items()],
        commit_delay_s=commit_delay,
    )


def plot_plan(plan: Plan, path: str) -> None:
    """Draw efficiency against the save interval to ``path`` (PNG), optimum and user intervals marked.

    Needs matplotlib (``pip install matplotlib``); uses the Agg canvas, never pyplot's global state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    opt = plan.optimal_interval_s
    marks = [opt, plan.young_interval_s, *(r.interval_s for r in plan.rows)]
    lo, hi = min(marks + [opt / 20]) / 1.5, max(marks + [opt * 20]) * 1.5
    xs = np.geomspace(lo, hi, 400)
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs / 60, 100 * plan.efficiency(xs), color="C0")
    e = plan.efficiency_at_optimum
    ax.axvline(opt / 60, color="C1", ls="--", lw=1)
    ax.plot([opt / 60], [100 * e], "o", color="C1", label=f"optimum ({100 * e:.2f}%)")
    ax.plot([plan.daly_interval_s / 60], [100 * plan.efficiency_at_daly], "v", color="C8", label="Daly's estimate")
    ax.plot([plan.young_interval_s / 60], [100 * plan.efficiency_at_young], "^", color="C2", label="Young")
    for i, r in enumerate(plan.rows):
        ax.plot([r.interval_s / 60], [100 * r.efficiency], "s", color=f"C{3 + i % 7}",
                label=f"{r.label} ({100 * r.efficiency:.2f}%)")
    if plan.commit_delay_s > lo:  # tau < W: a save waits for the previous one, which the curve does not count
        ax.axvspan(lo / 60, min(plan.commit_delay_s, hi) / 60, color="0.85", label="saves overlap: optimistic")
    ax.set_xscale("log")
    ax.set_xlim(lo / 60, hi / 60)
    ax.set_xlabel("compute time between saves (minutes)")
    ax.set_ylabel("efficiency: useful / wall time (%)")
    delay = f", commit {format_duration(plan.commit_delay_s)} later" if plan.commit_delay_s else ""
    ax.set_title(f"{plan.nodes} nodes, job MTBF {format_duration(plan.job_mtbf_s)}, "
                 f"stall {format_duration(plan.stall_s)}{delay}, restart {format_duration(plan.restart_s)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
