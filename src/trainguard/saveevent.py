"""The ``save`` event of the manager's event log, written once per committed save, on every rank, and rank
0's ``save_start`` as each save begins (:func:`started`).

Sync saves: :func:`at_sync_commit` writes it (``CheckpointManager._finish_pending``, in the save
call, once the save committed, before rank 0's retention deletes); the seconds the call then spent in
that retention (with a RAM tier: handing the step to its copy to disk) follow in rank 0's
``save_retention`` event (``step``, ``stall_s``), :func:`retention_waited`, which ``trainguard report``
adds to the save stall, and the save policy receives with the save's stall. Before, the ``save``
event was written after those deletes, its ``stall_s`` counting them: a process killed during them
(a lost node, ``TRAINGUARD_CRASH_AT=before_retention``) left a committed checkpoint out of the log.
Async saves: :func:`at_commit`
writes it when the save commits, on the thread that commits (the save thread; the training thread
when the save committed before ``CheckpointManager._track`` asked), before rank 0's retention of
that commit runs (``retention.at_commit``). Before, an async save was logged only when the next
``save()``/``wait()``/``close()`` collected it: a process killed after the commit and before that
(a ``trainguard run`` fault, a node lost) left a committed checkpoint, restored from later, out of the
log, and ``trainguard report`` counted one save fewer. ``report_saved`` then writes nothing more for
it (``handle.logged``): exactly once either way.

Fields (both paths): ``stall_s`` = ``stall_call_s`` (the ``save()`` call, the wait for the previous
save included, ``stall_prev_s``) + ``stall_hook_s`` (``optimizer.step()`` waiting for staging) +
``stall_wait_s`` (``wait_staged()`` waits); a sync save's retention is in its ``save_retention`` event.
``duration_s``: the call's start to the commit. Staging ends before the commit, so an async save's
waits are all counted by then, but for one that a waiting thread, woken as staging ended, had not yet
added when the save committed (microseconds against the save's writes and commit rounds).
The ``EventLog`` appends one whole line per ``write`` with ``O_APPEND``: the save thread and the
training thread may log at once without mixing lines.
"""

from __future__ import annotations

import time
from typing import Any

from . import replicas


def started(mgr: Any, step: int, values: Any) -> None:
    """``CheckpointManager._save_now``, every rank, as the save of ``step`` begins (it passed the manager's
    checks; its rounds and writes follow; a retry to the run directory after a RAM tier without room begins
    again): rank 0 logs ``save_start`` and keeps the step's metrics ``values`` for its retention
    (``retention._facts``; rank 0's alone: elsewhere they grew by one entry a save). Every save that begins
    then ends in rank 0's ``save`` or ``save_failed`` event of that step, by the same process; one with
    neither was cut short by the process's end (SIGKILLed by the agent while it waited for a dead peer,
    which left no ``save_failed``): ``trainguard report`` counts it as interrupted (``tally.SaveEnds``)."""
    if mgr.ctx.rank == 0:
        mgr._metrics[step] = values
        mgr.events.emit("save_start", step=step, async_save=mgr.async_save)


def at_commit(mgr: Any, handle: Any, step: int, t0: float) -> None:
    """``CheckpointManager._track`` of every save, every rank, once ``handle.stall_s`` and
    ``handle.prev_wait_s`` are set (the call's start ``t0``): an async save is logged when it
    commits, ahead of the commit's other callbacks (retention), exactly once; never one that fails.
    A sync save: nothing here (``policies.report_saved``, after its retention)."""
    if not mgr.async_save:
        return
    events = mgr.events

    def run(manifest: Any) -> None:
        finished = handle.finished_at if handle.finished_at is not None else time.monotonic()
        stall = handle.stall_s + handle.hook_wait_s + handle.wait_staged_s
        emit(events, handle, step, stall, finished - t0, manifest.total_bytes, async_save=True)
        handle.logged = True

    handle.after_commit(run, first=True)


def at_sync_commit(mgr: Any, handle: Any, step: int, stall: float, total_bytes: int) -> None:
    """``CheckpointManager._finish_pending`` of a sync save, every rank, once it committed and before
    rank 0's retention runs: its ``save`` event (``stall`` through the commit), exactly once
    (``handle.logged``: ``policies.report_saved`` writes nothing more). An async save: nothing here."""
    if not mgr.async_save:
        emit(mgr.events, handle, step, stall, handle.duration_s, total_bytes, async_save=False)
        handle.logged = True


def retention_waited(mgr: Any, step: int, seconds: float) -> float:
    """``CheckpointManager._finish_pending``, after the retention (or RAM tier hand-off) that followed
    the commit of ``step``, which took ``seconds``: the part of them the save's caller waited for, to
    add to the stall the policy receives (0.0 for an async save: its retention ran on the save thread).
    Rank 0 of a sync save logs it as ``save_retention``: after the ``save`` event, so a kill during the
    deletes leaves that event in the log, and ``trainguard report`` counts the deletes as save stall."""
    if mgr.async_save:
        return 0.0
    if mgr.ctx.rank == 0:
        mgr.events.emit("save_retention", step=step, stall_s=round(seconds, 6))
    return seconds


def emit(events: Any, h: Any, step: int, stall: float, duration: float, total_bytes: int, *, async_save: bool) -> None:
    """The ``save`` event of ``step`` (and the findings of its save: ``modified_while_staging``,
    rank 0's ``replicas_differ``), on ``events``, the manager's log of this rank."""
    finished = h.finished_at if h.finished_at is not None else time.monotonic()
    events.emit(
        "save", step=step, stall_s=round(stall, 6), duration_s=round(duration, 6),
        stall_call_s=round(h.stall_s, 6), stall_hook_s=round(h.hook_wait_s, 6), stall_wait_s=round(h.wait_staged_s, 6),
        stall_prev_s=round(h.prev_wait_s, 6), bytes=total_bytes, async_save=async_save,
        committed_t=round(time.time() - (time.monotonic() - finished), 6),  # wall time of the commit
    )
    if changed := getattr(h, "modified_while_staging", None):  # changed before the async save copied them (handle.py)
        events.emit("modified_while_staging", step=step, tensors=changed)
    if (found := replicas.take(step)) is not None:  # rank 0: replicated tensors that differed (replicas.py)
        events.emit("replicas_differ", step=step, **found)
