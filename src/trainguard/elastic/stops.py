"""What a stopped job tells its scheduler: the exit codes of a preemption (docs/elastic.md,
"Exit codes for a requeue wrapper").

A run stopped by a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) exits with 128 + the signal's
number (143 for SIGTERM), the shell's convention, whoever was signalled: the agent, every
process, or the workers alone (``scancel --signal=TERM`` on the step's tasks, a node agent
killing trainer processes), under ``trainguard run`` and, through ``mgr.exit_code``, under plain
``python``/``torchrun``. Two sides:

* workers: :meth:`CheckpointManager.save` (when a stop makes it set ``should_stop``) and
  ``close()`` (a signal that came while it waited for the last save) call :func:`note_stop`, which
  sets the manager's ``stopped_by`` (its ``exit_code`` is then 128 + that) and writes the signal's
  number into the file ``TRAINGUARD_STOP_FILE`` names (set by ``trainguard run``, one per agent);
* agent (:mod:`trainguard.elastic.launcher`): :func:`clear` before it starts workers (a stop its
  own restart caused is no preemption), :func:`stop_code` when the workers ended: a job whose
  workers all succeeded after a stop, or all exited with a stop code, ends with that code and is
  not restarted. A worker that exited 78 (:mod:`trainguard.permanent`: an error no restart fixes)
  is not restarted either (:func:`no_restart`) and the agent exits 78 (:func:`agent_result`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import Any

from .. import runlock
from ..permanent import PERMANENT_EXIT, headline
from . import errfiles, hangnote
from .faults import EXIT_CODE as FAULT_EXIT
from .watchdog import HANG_EXIT, ORPHAN_EXIT

STOP_FILE_ENV = "TRAINGUARD_STOP_FILE"
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
STOP_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)
PREEMPTED = 128 + int(signal.SIGTERM)  # a stop decided by another rank: its signal is not known here


def note_stop(mgr: Any, remote: bool = False) -> None:
    """``CheckpointManager.save`` on every rank when a stop signal (this process's own, or with
    ``remote`` another rank's) makes the ranks stop, and ``close()`` (this process's signal, if any):
    sets ``mgr.stopped_by`` once and tells ``trainguard run`` (the file :data:`STOP_FILE_ENV` names)."""
    own = mgr._signum if mgr._preempt.is_set() else 0
    if mgr.stopped_by is not None or not (own or remote):
        return
    mgr.stopped_by = int(own) or PREEMPTED - 128
    runlock.mark_stopping(getattr(mgr, "_lock", None), mgr.stopped_by)  # rank 0: a new incarnation waits for its last save
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        try:
            with open(path, "a") as f:
                f.write(f"{mgr.stopped_by}\n")
        except OSError:  # the agent then reports the job as it saw it; the manager's exit_code still says it
            pass


def stop_file(run_dir: str) -> str:
    """The agent's stop file (``trainguard run``'s ``prepare``): per host and agent, so agents of
    several nodes sharing a run directory each read their own workers'."""
    os.makedirs(os.path.join(run_dir, ".trainguard"), exist_ok=True)
    return os.path.join(run_dir, ".trainguard", f"stopped-{os.uname().nodename}-{os.getpid()}")


def clear(path: str | None) -> None:
    """Agent, before it starts (or restarts) its workers: a stop they noted before is forgotten."""
    if path:
        for note in [path, *glob.glob(glob.escape(path) + ".raised-*"), *glob.glob(glob.escape(path) + ".hang-*")]:  # and the workers' notes (note_raised, hangnote)
            with contextlib.suppress(FileNotFoundError):
                os.remove(note)


def stop_code(path: str | None, exitcodes: Iterable[int] = ()) -> int | None:
    """Agent: the exit code for a job whose workers ended with ``exitcodes`` (their failures; none
    when they all succeeded): a stop code (128 + the signal) when a worker exited with one and every
    other failure is one too or a kill by a signal (the agent's SIGTERM/SIGKILL of the slower peers),
    or when there is no failure and a worker noted a stop in ``path``; else None (finished, failed)."""
    codes = list(exitcodes)
    if codes:
        stopped = [c for c in codes if c in STOP_CODES]
        return stopped[0] if stopped and all(c in STOP_CODES or c < 0 for c in codes) else None
    try:
        with open(path or "") as f:
            seen = [int(x) for x in f.read().split() if x.isdigit()]
    except OSError:
        return None
    return 128 + seen[0] if seen else None


def agent_result(events: Any, failures: dict[int, Any]) -> int | None:
    """``trainguard run``'s ``main`` when torch's agent returned (``failures`` empty) or raised
    ``ChildFailedError`` (its failures): a stop code (:func:`stop_code`) is logged as ``agent_exit``
    (``preempted: true``), said on stderr and returned; None: finished or failed as torch says."""
    path = os.environ.get(STOP_FILE_ENV)
    code = stop_code(path, [f.exitcode for f in failures.values()])
    clear(path)  # read: the next agent's job starts without it
    permanent = sorted(r for r, f in failures.items() if f.exitcode == PERMANENT_EXIT)
    if permanent:
        f = failures[permanent[0]]
        message = getattr(f, "message", "") or ""  # the worker's error file (permanent._record), if any
        message = str(message.get("message", "") if isinstance(message, dict) else message)
        message = "" if message.startswith(("To enable traceback", "Signal")) else message
        events.emit("agent_exit", ok=False, permanent=True, ranks=permanent, error=message[-2000:])
        said = f": {headline(message).rstrip('.')}" if message.strip() else ""
        print(f"trainguard run: rank(s) {permanent} failed with an error a restart will not fix (exit {PERMANENT_EXIT})"
              f"{_others(failures)}; not restarted{said}. Fix it (see the worker's error above), then start again", file=sys.stderr)
        return PERMANENT_EXIT
    if code is not None:
        name = signal.Signals(code - 128).name
        events.emit("agent_exit", ok=False, signal=name, preempted=True)
        print(f"trainguard run: the workers were stopped by {name} (preemption: they saved and exited); "
              f"exit {code}: requeue the job to resume", file=sys.stderr)
    return code


def _others(failures: dict[int, Any]) -> str:
    """:func:`agent_result`'s line: how the group's other failed workers ended. torch's agent stops the
    rest of the group (SIGTERM) as soon as it sees one worker fail: a rank on its way to the same exit
    78 (a 3-rank restore refused on every rank) is then "killed by SIGTERM", and the line named two
    ranks of three without a word of the third (session 49)."""
    rest = sorted((r, f.exitcode) for r, f in failures.items() if f.exitcode != PERMANENT_EXIT)
    if not rest:
        return ""
    stopped = " (the agent stops the other workers once one failed)" if any(c == -signal.SIGTERM for _r, c in rest) else ""
    return "; " + ", ".join(f"rank {r} {exit_cause(c)}" for r, c in rest) + stopped


def exit_cause(exitcode: int) -> str:
    """Agent: a worker's exit code in words, for the ``failure`` event."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode in STOP_CODES:
        return f"stopped by {signal.Signals(exitcode - 128).name}"
    return {FAULT_EXIT: "injected exit", HANG_EXIT: "hang (watchdog)", ORPHAN_EXIT: "orphaned",
            PERMANENT_EXIT: "an error a restart will not fix"}.get(
        exitcode, f"exit code {exitcode}"
    )


TRACEBACK_MAX = 4096  # characters of a failed worker's traceback in the agent's failure event (its end)


def failure_detail(failure: Any) -> dict[str, str]:
    """Agent's monitor hook, for the ``failure`` event of rank ``failure`` (torch's ``ProcessFailure``):
    ``{"traceback": ...}``, the last :data:`TRACEBACK_MAX` characters of the traceback the worker left in
    torch's error file (``--run-path`` workers: torch's wrapper; script workers: the excepthook of ``import
    trainguard``, or torch's ``@record``), else its message; ``{}`` when it left none (a kill, ``os._exit``,
    ``sys.exit``, a script that never imported trainguard). Before, the event said "exit code 1" alone."""
    message = getattr(failure, "message", None)
    text = message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        text = extra.get("py_callstack") if isinstance(extra, dict) else None
        if not isinstance(text, str) or text.strip() in ("", "NoneType: None"):
            text = message.get("message")
    if not isinstance(text, str) or not text.strip() or text.startswith(("To enable traceback", "Signal ")):
        return {}
    return {"traceback": text[-TRACEBACK_MAX:]}


AGENT_STOPPED: set[int] = set()  # pids of workers the agent's failure close found running (reap.py)


def first_failure(failures: dict[int, Any]) -> int:
    """Agent: the rank that failed first, usually not exit 1 (peers failing in collectives) nor the
    agent's SIGTERM, nor a stop code (a peer that saved on the agent's SIGTERM). Among the rest, an
    exit 1 (a Python exception) comes before a rank the agent's own SIGTERM ended: script workers'
    failures list both, and the SIGTERMed peer (rank 0) was named for rank 1's exception. Of several
    exits 1, the first to raise (:func:`note_raised`): a late poll saw rank 0's too, and named it.
    A worker the agent stopped itself after the failure (:data:`AGENT_STOPPED`, noted by
    ``reap.bound_failure_close``) is never the cause while another failed: a peer that ignored the
    SIGTERM (a manager saving on it) was SIGKILLed 1 s later, read "killed by SIGKILL" like the rank
    really SIGKILLed, and rank 0 was named for rank 1's kill. A rank whose watchdog found it hung while
    blocked in a collective (:mod:`.hangnote`) is not the cause while another failed: rank 0, waiting in
    all_reduce, was named for rank 1's hang."""
    waited = hangnote.waiting(failures)  # hung while blocked in a collective: waiting for another rank
    rest = {r: f for r, f in failures.items() if r not in waited}
    if waited and rest:  # that rank is among the others, a rank the agent stopped (its watchdog came later) too
        failures = rest
    else:
        own = {r: f for r, f in failures.items() if getattr(f, "pid", None) not in AGENT_STOPPED}
        failures = own or failures
    special = [r for r, f in failures.items() if f.exitcode not in (1, -signal.SIGTERM, *STOP_CODES)]
    raised = [r for r, f in failures.items() if f.exitcode == 1]
    notes = {r: t for r in raised if (t := raised_at(getattr(failures[r], "pid", -1))) is not None}
    return min(special or ([min(notes, key=notes.__getitem__)] if notes else raised) or failures)


def no_restart(failures: dict[int, Any]) -> bool:
    """Agent's monitor hook: whether a worker exited :data:`PERMANENT_EXIT` (no restart fixes its error)."""
    return any(f.exitcode == PERMANENT_EXIT for f in failures.values())


OWN_EXITS = (FAULT_EXIT, HANG_EXIT, PERMANENT_EXIT)  # trainguard's own causes: a drill's exit, the watchdog's, exit 78


def root_failure(pc: Any, error: Exception) -> Exception:
    """The failure to report for a torch ``ProcessContext`` whose ``join`` raised ``error``.

    Called by the agent's ``ProcessContext.join`` hook, in the agent, after torch's ``join``
    found a failed worker and stopped the others. ``join`` reports the first failed process it
    finds among those ready, in process order: when rank 1's watchdog ended it (exit 75) and rank
    0 then failed in its broken collective (exit 1) before the agent looked, rank 0 was reported
    and the hang was recorded as "exit code 1". A worker that ended with one of trainguard's own
    exit codes (:data:`OWN_EXITS`) is the cause: a new exception names it (:func:`.errfiles.failure`: with the
    traceback the worker wrote, if any); not a hung one that waited in a collective (:mod:`.hangnote`) while another failed."""
    reported = getattr(error, "error_index", None)
    procs = list(getattr(pc, "processes", []))
    raised = {i: t for i, p in enumerate(procs) if p.exitcode == 1 and (t := raised_at(p.pid)) is not None}
    if reported is None or not 0 <= reported < len(procs):
        return error
    waited = hangnote.waiting(dict(enumerate(procs)))  # hung while blocked in a collective: not the cause
    others = [i for i, p in enumerate(procs) if i not in waited and p.exitcode not in (0, None)]
    if reported in waited and others:  # it waited for one of these: a hung one, else the one torch stopped
        i = next((i for i in others if procs[i].exitcode in OWN_EXITS), others[0])
        return errfiles.failure(pc, i)
    if procs[reported].exitcode in OWN_EXITS:
        return error
    for i, proc in enumerate(procs):
        if proc.exitcode in OWN_EXITS and i not in waited:
            return errfiles.failure(pc, i)
    # Several raised (exit 1): the first to raise, not the first in process order. Rank 1's exception
    # ended its process, rank 0's collective then failed (exit 1): rank 0 was named (2 of 2 runs).
    if reported in raised and (first := min(raised, key=raised.__getitem__)) != reported:
        return errfiles.failure(pc, first)  # with its traceback (errfiles.py): it was "exit code 1" alone
    return error


def _raised_file(pid: int) -> str | None:
    path = os.environ.get(STOP_FILE_ENV)
    return f"{path}.raised-{pid}" if path else None


def note_raised() -> None:
    """A worker whose script raised (``--run-path``: :func:`trainguard.permanent.run_script_path`; a
    script: the ``sys.excepthook`` of ``import trainguard``), at once: when, for the agent's
    :func:`root_failure` and :func:`first_failure` (a peer failing in its collective raises later)."""
    path = _raised_file(os.getpid())
    with contextlib.suppress(OSError):
        if path:
            with open(path, "w") as f:
                f.write(str(time.time_ns()))


def raised_at(pid: int) -> int | None:
    """Agent (:func:`root_failure`): when worker ``pid`` noted its exception (:func:`note_raised`),
    None if it did not; the note is removed."""
    text = hangnote.take(_raised_file(pid))
    return int(text) if text is not None and text.isdigit() else None


def quiet_stop(record: Any) -> None:
    """Agent, the log filter of :mod:`.launcher` (torch's loggers): torch logs a worker's exit with
    the ``ProcessExitedException`` traceback of its ``join``, as for a crash; for a worker that
    exited 128 + a stop signal (it saved and stopped, a preemption) the line stays, at INFO, without it."""
    if str(record.msg).startswith("failed (exitcode: ") and record.args and record.args[0] in STOP_CODES:
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, 20, "INFO"
