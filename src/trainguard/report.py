"""Summary and timeline of a run's event log (``<run dir>/events.jsonl``).

:func:`summarize` is pure (events in, numbers out); ``trainguard report RUN_DIR`` prints the same
numbers of a log read once with bounded memory (:func:`tally_log`: a :class:`~trainguard.tally.Tally`
of it, then :func:`summary`), and ``--plot timeline.png`` draws steps over wall time with saves,
failures and restores (:func:`plot_tally`).
Events come from the agent (rank -1: ``agent_start``, ``rendezvous``, ``failure``,
``restart``, ``agent_exit``), from rank 0's heartbeat (``step``, ``first_step``, ``fault``)
and from the manager on every rank (``save``, ``restore``, ``save_failed``, ``fresh_start``; rank 0's
``save_start``: the saves that never ended, :mod:`.saveends`); the events of things that went wrong besides
(``restore_skip``, ``retention_damaged``, ``store_lost``...: :mod:`.problems`) get a line each.

Recovery of failure *i*, split in four: **detect** (fault injected, or hang declared -> agent saw
it; unknown for a real crash), **restart** (agent saw it -> restore began in the new workers: stop,
rendezvous, new processes, imports, process group), **restore** (the manager's load), **first
step** (restore done -> first training step finished).
"""

from __future__ import annotations

import bisect
import os
import statistics
from collections.abc import Iterable
from typing import Any

from . import eventscan, problems
from . import tally as tally_mod
from .events import read_events
from .tally import Tally, Unordered


def _first_from(events: list[tuple[int, dict[str, Any]]], at: list[int], q: int, end: float = float("inf")) -> dict[str, Any] | None:
    """``summary``: the first of ``events`` (``(seq, event)`` in the log's order, ``at`` their seqs) after
    the event at ``q`` and before ``end`` (the next job's start: a later job's restore is not this
    failure's): a bisection, not a scan from the start of the log per failure (O(failures x events))."""
    i = bisect.bisect_right(at, q)
    return events[i][1] if i < len(events) and at[i] < end else None


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Failures, lost work, recovery times, checkpoint overhead and goodput of one run: of ``events``
    in the log's order (as ``read_events`` yields them): a failure is paired with the restore and first
    step logged after it, and a step logged earlier in time than the one before it is a clock set back
    (``tally.py``); steps and saves are taken in time order. ``trainguard report`` reads a log with
    :func:`tally_log`: the same numbers."""
    tally = Tally(window=None)
    for e in events:
        tally.add(e)
    return summary(tally.finish())


def tally_log(run_dir: str | os.PathLike[str], *, timeline: bool = False) -> Tally:
    """The :class:`~trainguard.tally.Tally` of the log in ``run_dir`` (or at that path), read once with
    bounded memory; read again keeping every step and save in memory when their times go back by
    more than the tally's window (a clock set back: :class:`~trainguard.tally.Unordered`)."""
    try:
        return eventscan.feed(run_dir, Tally(tally_mod.WINDOW, timeline=timeline)).finish()
    except Unordered:
        return eventscan.feed(run_dir, Tally(window=None, timeline=timeline)).finish()


def summary(tally: Tally, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """:func:`summarize`'s numbers from a finished tally (steps and saves sorted by time, stably;
    incidents in the order fed). ``root``: the directory of the log (``trainguard report RUN_DIR``), where
    an interrupted save's checkpoint may lie committed (:func:`_committed_on_disk`)."""
    if not tally.events:
        return {"events": 0}
    # Incidents are paired in the log's order (a failure's restore is logged after it), not by their
    # times: a clock set back during a restart put the restore before the failure (no recovery found).
    failures = tally.at("failure")
    faults = tally.at("fault", "hang")  # injected, or a hang the watchdog declared
    # rank 0's restore, or its fresh start (a restart with no checkpoint: no restored step)
    restores = tally.at("restore", "fresh_start")
    firsts = tally.at("first_step")
    fault_q, restore_q, first_q = ([q for q, _ in x] for x in (faults, restores, firsts))
    jobs: dict[Any, int] = {}  # each job's first agent start: a later job's restore is not an earlier job's failure's
    for q, e in tally.at("agent_start"):
        jobs.setdefault(e.get("job_id"), q)
    bounds = sorted(jobs.values())
    recoveries = []
    prev_q = -1
    # A first step's lost_steps counts once: one incident logs several failures and restarts before the
    # group trains again (a restart killed in its restore fails again; the other agent of a dead worker
    # restarts for "membership"), and each found the same first step (its steps were counted twice).
    claimed: set[int] = set()
    for fq, f in failures:
        # The last fault after the previous failure and before this one, the first restore or fresh start
        # (rank 0) and first step after it, before the next job starts (another node's failure or agent
        # of this job: no bound).
        i = bisect.bisect_right(fault_q, fq)
        fault = faults[i - 1][1] if i and fault_q[i - 1] > prev_q else None
        end = next((b for b in bounds if b > fq), float("inf"))
        restore = _first_from(restores, restore_q, fq, end)
        restore = restore if restore is None or restore["event"] == "restore" else None
        first = _first_from(firsts, first_q, fq, end)
        rec: dict[str, Any] = {"t": f["t"], "rank": f.get("rank"), "cause": f.get("cause"),
                               "restored_step": restore["step"] if restore else None,
                               "lost_steps": None if first is None else 0 if id(first) in claimed else first.get("lost_steps")}
        if first is not None:
            claimed.add(id(first))
        seen = f["t"] - _given(f, "stop_s")  # the agent saw it; it logged it once it had stopped the other workers
        if fault:
            rec["detect_s"] = _span(fault["t"], seen)
            rec["fault_step"] = fault.get("step")
        if restore:
            seconds = _given(restore, "seconds")
            rec["restart_s"] = _span(seen, restore["t"] - seconds)
            rec["restore_s"] = seconds
        if first:
            if restore:
                rec["first_step_s"] = _span(restore["t"], first["t"])
            rec["recover_s"] = _span(fault["t"] if fault else seen, first["t"])
        recoveries.append(rec)
        prev_q = fq
    # Steps lost at a restart for a joining agent (scale-up): those run after the checkpoint the group
    # restored, e.g. without a preemption save (handle_signals=False, or its save did not happen).
    # A membership restart whose first step a failure's recovery reached is part of that recovery (the
    # other agent of a failed worker saw the failed one's agent waiting), not a restart for a joining agent.
    joined_lost = joined = 0
    for rq, _r in tally.at("restart"):  # those with reason "membership" (the tally keeps no other)
        end = min([b for b in bounds if b > rq] + [fq for fq, _ in failures if fq > rq] + [float("inf")])
        first = _first_from(firsts, first_q, rq, end)
        if first is not None and id(first) in claimed:
            continue
        joined += 1
        joined_lost += (first.get("lost_steps") or 0) if first else 0
        if first is not None:
            claimed.add(id(first))
    # Lost at a start no failure or membership restart of this log led to: the whole job had died (every
    # agent: a requeue after a node failure, a lost one-node job) and was started again.
    resubmit_lost = sum(e.get("lost_steps") or 0 for _, e in firsts if id(e) not in claimed)
    start_t = next((e["t"] for e in tally.of("agent_start")), tally.first)
    final, last = tally.final, tally.last
    if tally.set_back > 0 or (tally.went_back and tally.went_forward):
        # A clock set back (tally.py): the last step logged, the time the clock went back counted. Set forward too
        # (measured: mono): the greatest t is of a time it was ahead, not the end (since review52c); a step forward
        # alone stays wall time.
        final, last = tally.log_final, tally.tail + tally.set_back if tally.went_forward else max(last, tally.tail + tally.set_back)
    wall = last - start_t
    step_s = tally.median_step()  # of the time between consecutive steps of one process
    stall, logged = tally.stall, tally.saves
    unlogged_steps = _restored_unlogged(tally.at("restore", "fresh_start"), tally.saved_steps)
    ends = tally.save_ends  # saveends.py: a save killed after its commit, restored later, is a save, not interrupted
    unlogged_steps |= _committed_on_disk(root, ends.interrupted(), tally.saved_steps)  # or not restored (yet)
    unlogged = len(unlogged_steps)
    saves = logged + unlogged
    interrupted = [(t, step) for t, step in ends.interrupted() if step not in unlogged_steps]
    ended_badly = sorted([{"t": t, "step": step, "how": "failed", "error": err} for t, step, err in ends.failed]
                         + [{"t": t, "step": step, "how": "interrupted"} for t, step in interrupted], key=lambda x: x["t"])
    useful = (final or 0) * step_s if step_s else None
    return {
        "events": tally.events,
        "wall_s": wall,
        "final_step": final,
        "steps_run": tally.runs.count,  # distinct (pid, step)
        "step_s": step_s,
        "failures": len(failures),
        "recoveries": recoveries,
        "lost_steps": sum(r["lost_steps"] or 0 for r in recoveries) + joined_lost + resubmit_lost,
        "membership_lost_steps": joined_lost,
        "resubmit_lost_steps": resubmit_lost,
        "saves": saves,
        "saves_unlogged": unlogged,
        "save_stall_s": stall,
        "save_stall_mean_s": stall / logged if logged else None,
        "save_duration_mean_s": statistics.mean(tally.durations) if logged else None,
        "save_bytes": tally.save_bytes,
        "checkpoint_overhead": stall / wall if wall > 0 else None,
        "goodput": min(1.0, useful / wall) if useful and wall > 0 else None,
        # Every agent logs each rendezvous round: count node 0's (logs without node_rank: all).
        "world_sizes": [(round(e["t"] - start_t, 3), e.get("world_size")) for e in tally.of("rendezvous")],
        "hangs": len(tally.of("hang")),
        # Group restarts because an agent joined (scale-up), not because a worker failed.
        "membership_restarts": joined,
        # Saves that did not commit (saveends.py): rank 0's save_failed events, and saves it began whose process
        # ended before it logged either end (null: a log from before save_start events, interrupted ones unknown).
        "saves_failed": len(ends.failed),
        "saves_interrupted": len(interrupted) if ends.starts else None,
        "failed_saves": ended_badly,
        # Restores that skipped a checkpoint, damaged kept checkpoints, the store lost... (problems.py): once per
        # event name and step, whichever ranks logged it.
        "problems": tally.problems.listed(),
    }


def _restored_unlogged(starts: list[tuple[int, dict[str, Any]]], saved: set[Any]) -> set[Any]:
    """``summary``: the steps of checkpoints rank 0 restored that have no save event in the log, saved
    by a process of this log: one killed right after the commit, before it logged the save (one save
    more, its stall unknown). Only a step above one an earlier start (``starts``: rank 0's restores
    and fresh starts, which found none, in the log's order) began at: a checkpoint the log's first start restored
    was saved before the log (copied into a new run directory to go on from it, a log deleted), not
    by a process that was killed here (counted as a save killed at its commit before)."""
    low: Any = None  # the lowest step an earlier start began at
    out: set[Any] = set()
    for _q, e in starts:
        step = e.get("step") if e["event"] == "restore" else -1  # a fresh start found none: any later one was saved here
        if e["event"] == "restore" and step not in saved and low is not None and step > low:
            out.add(step)
        low = step if low is None or step < low else low
    return out


def _committed_on_disk(root: Any, interrupted: list[tuple[Any, Any]], saved: set[Any]) -> set[Any]:
    """``summary``: the steps of interrupted saves (``(t, step)``, :meth:`.saveends.SaveEnds.interrupted`) whose
    checkpoint lies committed in ``root`` (its ``step-N/manifest.json``) and that no save event of the log
    saved: killed after the commit, before the save event, and not restored since (the job's last save, its
    restarts used up: ``TRAINGUARD_CRASH_AT=after_rename``). A save, as one a later start restored
    (:func:`_restored_unlogged`); before, it was reported as interrupted "before the save committed" while its
    checkpoint was on disk. ``root`` None (:func:`summarize`: events alone): none."""
    if root is None:
        return set()
    from . import layout

    out = set()
    for _t, step in interrupted:
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0 and step not in saved:
            if os.path.isfile(os.path.join(os.fspath(root), layout.step_dir(step), layout.MANIFEST)):
                out.add(step)
    return out


def _span(a: Any, b: Any) -> Any:
    """``b - a``, the seconds from one event to a later one; None (unknown, ``-``) when the clock went
    back between them by more than ``tally.SET_BACK_MIN`` (a duration of -3597 s across an NTP step)."""
    return None if b - a < -tally_mod.SET_BACK_MIN else b - a


def _given(e: dict[str, Any], key: str) -> Any:
    """``e[key]``, 0.0 when it is missing or null (read_events lets a number be null: a line another
    tool wrote; ``restore["t"] - None`` was a TypeError traceback from ``trainguard report``)."""
    v = e.get(key)
    return 0.0 if v is None else v


def load(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(read_events(run_dir))


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _apart(s: dict[str, Any]) -> str:
    """``format_summary``: the lost steps counted apart from those of failures, if any."""
    parts = [f"{s['membership_lost_steps']} at restarts for joining agents"] if s.get("membership_lost_steps") else []
    parts += [f"{s['resubmit_lost_steps']} at starts of the whole job again"] if s.get("resubmit_lost_steps") else []
    return f" ({', '.join(parts)})" if parts else ""


def _unlogged(s: dict[str, Any]) -> str:
    """``format_summary``: the saves counted from a restore of their checkpoint, if any."""
    n = s.get("saves_unlogged")
    return f" ({n} with no save event, known from its restore or its checkpoint on disk: killed at its commit)" if n else ""


def _failed_saves(s: dict[str, Any]) -> list[str]:
    """``format_summary``: the line of the saves that did not commit, if any (none: no line, as before)."""
    failed, interrupted, listed = s.get("saves_failed") or 0, s.get("saves_interrupted") or 0, s.get("failed_saves") or []
    if not failed and not interrupted:
        return []

    def steps(how: str) -> str:
        these = [str(x["step"]) for x in listed if x["how"] == how]
        return ("step " if len(these) == 1 else "steps ") + ", ".join(these[:10]) + (", ..." if len(these) > 10 else "")

    parts = [f"{interrupted} interrupted ({steps('interrupted')}: begun, then its process ended before the save "
             "committed or failed)"] if interrupted else []
    first = next((x.get("error") or "" for x in listed if x["how"] == "failed"), "")
    parts += [f"{failed} failed ({steps('failed')}; the first: {first.splitlines()[0][:160] if first else '-'})"] if failed else []
    return [f"failed saves       {failed + interrupted}: {'; '.join(parts)}"]


def format_summary(s: dict[str, Any]) -> str:
    """The text ``trainguard report`` prints."""
    if not s.get("events"):
        return "no events"
    lines = [
        f"wall time          {_f(s['wall_s'])} s, final step {_f(s['final_step'], '{}')}, {s['steps_run']} steps run, "
        f"median step {_f(s['step_s'], '{:.4f}')} s",
        f"world sizes        {', '.join(f'{w} at {t:.1f}s' for t, w in s['world_sizes']) or '-'}"
        f" ({s.get('membership_restarts', 0)} restarts for joining agents)",
        f"failures           {s['failures']} (hangs detected: {s['hangs']}), lost steps {s['lost_steps']}" + _apart(s),
    ]
    for i, r in enumerate(s["recoveries"], 1):
        lines.append(
            f"  #{i} rank {r['rank']} {r['cause']}: restored step {r['restored_step']}, lost {r['lost_steps']}; "
            f"recover {_f(r.get('recover_s'))} s = detect {_f(r.get('detect_s'))} + restart "
            f"{_f(r.get('restart_s'))} + restore {_f(r.get('restore_s'))} + first step {_f(r.get('first_step_s'))}"
        )
    lines += [
        f"checkpoints        {s['saves']} saves{_unlogged(s)}, stall {_f(s['save_stall_s'], '{:.3f}')} s total "
        f"({_f(s['save_stall_mean_s'], '{:.4f}')} s each), duration {_f(s['save_duration_mean_s'], '{:.3f}')} s, "
        f"{_f(s['save_bytes'], '{:,}')} bytes",
        *_failed_saves(s),
        f"checkpoint overhead {_f(None if s['checkpoint_overhead'] is None else 100 * s['checkpoint_overhead'])} % of wall time",
        f"goodput            {_f(None if s['goodput'] is None else 100 * s['goodput'], '{:.1f}')} % "
        "(final step x median step time / wall time)",
        *problems.lines(s),  # a restore that skipped a checkpoint, a damaged kept one, the store lost...: if any
    ]
    if not s["saves"] and not any(r.get("restored_step") is not None for r in s["recoveries"]):
        lines.append("note               no save or restore logged here: a CheckpointManager logs into its own root "
                     "(CheckpointManager(root)/events.jsonl); make that root this directory, or run the report on it")
    return "\n".join(lines)


def plot_timeline(events: Iterable[dict[str, Any]], path: str | os.PathLike[str], *, title: str = "") -> None:
    """Steps over wall time (one line per worker process), saves, failures and restores."""
    tally = Tally(window=None, timeline=True)
    for e in events:
        tally.add(e)
    plot_tally(tally.finish(), path, title=title)


def plot_tally(tally: Tally, path: str | os.PathLike[str], *, title: str = "") -> None:
    """:func:`plot_timeline` of a finished tally made with ``timeline=True``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert tally.points is not None, "plot_tally needs a Tally(timeline=True)"
    t0 = next((e["t"] for e in tally.of("agent_start")), 0.0 if tally.first is None else tally.first)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (ts, steps) in enumerate(tally.points.values()):
        if any(b < a for a, b in zip(ts, ts[1:])):  # a process's steps out of time order (a clock set back)
            order = sorted(range(len(ts)), key=ts.__getitem__)
            ts, steps = [ts[k] for k in order], [steps[k] for k in order]
        ax.plot([t - t0 for t in ts], steps, color="C0", lw=1.5, label="training (rank 0)" if i == 0 else None)
    ax.scatter([c - t0 for c, _ in tally.save_points], [s for _, s in tally.save_points], marker="|", s=120,
               color="C2", label="checkpoint committed")
    for i, e in enumerate(tally.of("failure")):
        ax.axvline(e["t"] - t0, color="C3", ls="--", label="failure detected" if i == 0 else None)
    restores = tally.of("restore")  # rank 0's
    ax.scatter([e["t"] - t0 for e in restores], [e["step"] for e in restores], marker="o", color="C1",
               zorder=3, label="restored")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ax.set_title(title or "trainguard run timeline")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
