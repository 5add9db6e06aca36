"""Per-worker progress heartbeat, hang watchdog and orphan check.

The training loop reports progress once per step: :meth:`CheckpointManager.save` calls
:func:`heartbeat` for you, or call ``tg.elastic.heartbeat(step)`` yourself. Each call, on
every rank, in this order: (1) rank 0 appends a ``step`` event to the run's event log (and,
on its first call in this process, a ``first_step`` event with the steps of this job lost
since its last run: see :func:`_lost_steps`); (2) the watchdog notes the time; (3) any fault
drill for this rank and step fires (:mod:`.faults`).

The watchdog is a daemon thread, started by the first heartbeat when ``TRAINGUARD_WATCHDOG=1``
(``trainguard run`` sets it). It ends the worker with exit code 75 when

* no heartbeat came for longer than the timeout: ``TRAINGUARD_HANG_TIMEOUT`` seconds if set,
  else ``max(floor, factor * longest of the last 50 gaps)`` (floor ``TRAINGUARD_HANG_FLOOR``,
  default 60 s; the watchdog is armed at the first heartbeat, so imports, rendezvous and
  restore are not timed). It first dumps every thread's Python stack (faulthandler) to
  stderr and to ``<run dir>/hang-rank<R>-<pid>.txt``, and logs a ``hang`` event. A rank
  blocked in a collective because its peer died or hangs stops beating too, so it is covered:
  gloo has no watchdog of its own.
* its elastic agent died: an orphaned worker would otherwise keep training and hold its peers
  in collectives (``orphaned`` event, exit code 76). ``trainguard run`` exports the agent's pid
  as ``TRAINGUARD_AGENT_PID``; the watchdog checks that this process still exists, is no zombie,
  and has the start time it had when the watchdog was armed (a reused pid is not the agent; a
  process that started after this worker is not its agent either).
  With ``--start-method forkserver`` a worker's parent is the forkserver, which outlives the
  agent as long as any worker does, so the parent pid alone says nothing there. Without the
  variable (plain torchrun) the check is ``os.getppid()`` against the parent at arm time.

No hang is declared while the watchdog is paused: :func:`paused` around each save, restore and wait
(:func:`untimed`), :func:`suspend` from ``CheckpointManager.close`` (called by the manager); the
orphan check goes on. One exception: inside a save, a storage call (a write, fsync, rename,
listing) that has not returned for the manager's ``timeout`` plus a grace (:func:`stuck_limit`) is
a hang too (exit 75, the stacks name the call). A *sync* save's write runs in the training thread,
so nothing else could end it: a hung NFS server held the worker for good, its peers waiting in
their next collective. An async save's stuck write is raised as ``StuckWriteError`` within the
timeout by the manager's wait; the grace lets that come first. The thread only reads a clock,
``os.getppid()``, ``/proc/<agent pid>/stat`` or the table of storage calls in flight
(``iostall.oldest``); gloo waits release the GIL, so it runs while the main thread is blocked in a
collective.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import mmap
import os
import re
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .. import iostall
from ..distwait import default_timeout
from ..events import EVENTS_FILE, EventLog
from ..events import event_at as _event_at
from . import hangnote
from .faults import Fault, faults_from_env, fired, maybe_fire, run_dir
from .reap import end_children

HANG_EXIT = hangnote.HANG_EXIT  # exit code of a worker the watchdog ended as hung
ORPHAN_EXIT = 76
AGENT_PID_ENV = "TRAINGUARD_AGENT_PID"  # set by ``launcher.prepare`` for its workers


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of ``pid`` from ``/proc/<pid>/stat``;
    None where it cannot be read (no such process, or no /proc). Called by :class:`Watchdog`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return fields[0].decode(), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def agent_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` exists, is not a zombie, and (when ``start`` is known) still has
    start time ``start``. Called by the watchdog thread every ``check_every`` seconds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process of another user has this pid: /proc's start time tells whether it is ours
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc (macOS): the signal check is all there is
    state, started = stat
    return state not in ("Z", "X", "x") and (start is None or started == start)


def _agent_start(pid: int) -> int | None:
    """The start time of the agent ``pid`` when the watchdog is armed (:class:`Watchdog`), None
    without /proc. The agent predates its workers: a process that started after this one has
    the agent's pid reused, and gets a start time no process has (reported gone at once)."""
    agent, me = _proc_stat(pid), _proc_stat(os.getpid())
    if agent is None:
        return None
    return -1 if me is not None and agent[1] > me[1] else agent[1]


class Watchdog:
    """Ends this process when progress stops or the parent dies. One per worker process."""

    def __init__(
        self,
        *,
        timeout: float | None = None,
        floor: float = 60.0,
        factor: float = 10.0,
        check_every: float = 0.2,
        parent_pid: int | None = None,
        agent_pid: int | None = None,
        events: EventLog | None = None,
        dump_dir: str | None = None,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"hang timeout {timeout!r}: must be > 0 seconds")
        self.timeout = timeout
        self.floor = floor
        self.factor = factor
        self.check_every = check_every
        self.parent_pid = parent_pid
        self.agent_pid = agent_pid  # when set, checked instead of parent_pid (see the module docstring)
        self._agent_start = _agent_start(agent_pid) if agent_pid is not None else None
        self.events = events or EventLog(None)
        self.dump_dir = dump_dir
        self._last: float | None = None
        self._paused = False
        self._stuck_after: float | None = None  # paused for a save: a storage call in flight longer is a hang
        self._step: int | None = None
        self._gaps: deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int | None = None) -> None:
        now = time.monotonic()
        if self._last is not None and not self._paused:
            self._gaps.append(now - self._last)
        self._last, self._step, self._paused = now, step, False

    def pause(self, stuck_after: float | None = None) -> None:
        """Stop timing (a save in progress, training over) until :meth:`resume` or the next beat;
        ``stuck_after``: a storage call in flight for longer still ends the worker (a save's pause)."""
        self._paused, self._stuck_after = True, stuck_after

    def resume(self) -> None:
        """Time again from now; the paused time is no gap between steps."""
        if self._paused:
            self._last, self._paused = time.monotonic(), False

    def current_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        longest = max(self._gaps, default=0.0)
        return max(self.floor, self.factor * longest)

    def orphaned(self) -> bool:
        """Whether the agent is gone: ``agent_pid`` is no longer the process it was at arm time,
        or, without it, the parent changed. Called by the watchdog thread."""
        if self.agent_pid is not None:
            return not agent_alive(self.agent_pid, self._agent_start)
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            if self.orphaned():
                agent = self.agent_pid if self.agent_pid is not None else self.parent_pid
                self.events.emit("orphaned", parent_pid=self.parent_pid, agent_pid=agent)
                print(f"trainguard: agent (pid {agent}) is gone; this worker exits", file=sys.stderr, flush=True)
                end_children()  # its DataLoader processes: no agent is left to end them (they lived ~5 s on)
                os._exit(ORPHAN_EXIT)
            last = self._last
            if last is not None and not self._paused and time.monotonic() - last > self.current_timeout():
                self._on_hang(time.monotonic() - last)
            limit = self._stuck_after
            if self._paused and limit is not None and (late := iostall.oldest()) is not None and late[0] > limit:
                self._on_hang(late[0], stuck=late[1], limit=limit)

    def _on_hang(self, idle: float, stuck: str | None = None, limit: float = 0.0) -> None:
        stacks = ""
        if self.dump_dir:
            path = os.path.join(self.dump_dir, f"hang-rank{self.events.rank}-{os.getpid()}.txt")
            try:
                with open(path, "w+") as f:
                    faulthandler.dump_traceback(file=f, all_threads=True)
                    f.seek(0)
                    stacks = f.read()
            except OSError:
                stacks = ""
        if stuck:
            what = (f"a save has been stuck for {idle:.1f} s in {stuck} (limit {limit:.1f} s: the manager's "
                    f"timeout and a grace; the storage does not answer), last step {self._step}")
        else:
            what = f"no progress for {idle:.1f} s (timeout {self.current_timeout():.1f} s, last step {self._step})"
        print(f"trainguard: {what} on rank {self.events.rank}; Python stacks follow, then the worker exits",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        waiting = hangnote.record()  # blocked in a collective (a peer hangs): the agent names another rank
        self.events.emit(
            "hang", step=self._step, idle_s=round(idle, 3), stacks=stacks[-20000:], waiting_in=waiting,
            **({"stuck_call": stuck, "timeout_s": round(limit, 3)} if stuck else
               {"timeout_s": round(self.current_timeout(), 3)}),
        )
        os._exit(HANG_EXIT)


class _Heart:
    """Process-wide state of :func:`heartbeat`; built from the environment at the first call."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rd = run_dir()
        self.events = EventLog(os.path.join(rd, EVENTS_FILE) if rd else None, rank=self.rank)
        self.faults: list[Fault] = faults_from_env()
        for f in self.faults if self.rank == 0 else []:
            if f.rank >= self.world_size and not fired(f):  # a job may grow to it later: a warning, not an error
                warnings.warn(f"fault drill {f.spec()!r} does not fire while this job has {self.world_size} "
                              f"rank(s) (0..{self.world_size - 1}); name one of them with rank=", stacklevel=3)
        self.first = True
        self.watchdog: Watchdog | None = None
        if os.environ.get("TRAINGUARD_WATCHDOG") == "1":
            t = os.environ.get("TRAINGUARD_HANG_TIMEOUT")
            self.watchdog = Watchdog(
                timeout=float(t) if t else None,
                floor=float(os.environ.get("TRAINGUARD_HANG_FLOOR", "60")),
                parent_pid=os.getppid(), agent_pid=_agent_pid(),
                events=self.events, dump_dir=rd,
            ).start()

    def beat(self, step: int) -> None:
        if self.rank == 0 and self.events.path is not None:
            if self.first:
                self.events.emit("first_step", step=step, world_size=self.world_size,
                                 lost_steps=_lost_steps(self.events.path, step, os.environ.get("TRAINGUARD_JOB_ID")))
            # mono: the clock an NTP step does not move, so report tells a set-back from a pause (tally.py)
            self.events.emit("step", step=step, world_size=self.world_size, mono=round(time.monotonic(), 6))
        self.first = False
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.faults:
            maybe_fire(step, self.rank, self.faults)


def _agent_pid() -> int | None:
    """The agent's pid that ``trainguard run`` exported (``TRAINGUARD_AGENT_PID``), if any."""
    try:
        pid = int(os.environ.get(AGENT_PID_ENV, ""))
    except ValueError:
        return None
    return pid if pid > 0 else None


def _lost_steps(path: os.PathLike[str] | str, step: int, job: str | None = None) -> int:
    """Steps done by an earlier run of this job beyond the one this run resumed from (rank 0's
    first heartbeat in a process calls it, for the ``first_step`` event).

    Only this job's ``step`` events count, not those of an earlier job in the same run directory:
    those after an ``agent_start`` with ``job_id == job`` (``TRAINGUARD_JOB_ID``: the rendezvous
    id, or a fresh uuid per ``trainguard run`` without one), up to an ``agent_start`` of another
    job; when the log has no ``agent_start`` of ``job`` (plain torchrun), those after the last
    ``agent_start``, or all of them when there is none.

    The log grows by a line per step (600,000 lines, 52 MB, over a week at a step a second), so
    it is not parsed line by line (that took 1.6 s of that first step): only ``agent_start``
    lines, found by a byte search, and, from the end of the one segment that counts, the lines
    that may be its last ``step`` event."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            last = _last_step(buf, job)
    if not isinstance(last, int) or last < step:
        return 0
    return last - (step - 1)


_AGENT_START = re.compile(rb'"event":\s*"agent_start"')


def _last_step(buf: Any, job: str | None) -> Any:
    """``_lost_steps``'s "last step" of ``job`` in the log ``buf`` (None: none)."""
    segments: list[tuple[int, bool]] = []  # (offset after an agent_start line, whether it is job's)
    for m in _AGENT_START.finditer(buf):
        a, b, ev = _event_at(buf, m.start())
        if ev is not None and ev.get("event") == "agent_start" and (not segments or segments[-1][0] <= a):
            segments.append((b, job is not None and ev.get("job_id") == job))
    ends = [buf.rfind(b"\n", 0, lo) + 1 for lo, _ in segments[1:]] + [len(buf)]  # each segment ends where the next starts
    if any(mine for _, mine in segments):
        for (lo, mine), hi in reversed(list(zip(segments, ends))):
            found = _last_step_in(buf, lo, hi) if mine else _NONE
            if found is not _NONE:
                return found
        return None
    found = _last_step_in(buf, segments[-1][0] if segments else 0, len(buf))
    return None if found is _NONE else found


_NONE = object()


def _last_step_in(buf: Any, lo: int, hi: int) -> Any:
    """The ``step`` field of the last ``step`` event between byte offsets ``lo`` and ``hi``, or ``_NONE``."""
    while hi > lo:
        i = buf.rfind(b'"step"', lo, hi)
        if i < 0:
            return _NONE
        a, _, ev = _event_at(buf, i)
        if ev is not None and ev.get("event") == "step":
            return ev.get("step")
        hi = a  # before that line (a "step" field of another event, or a torn line)
    return _NONE


_HEART: _Heart | None = None
_LOCK = threading.Lock()


def heartbeat(step: int) -> None:
    """Report that this worker finished ``step``. Call on every rank, once per step (the manager's
    ``save()`` does). Cheap and a no-op outside ``trainguard run`` unless ``TRAINGUARD_FAULT`` is set."""
    global _HEART
    if _HEART is None:
        with _LOCK:
            if _HEART is None:
                _HEART = _Heart()
    _HEART.beat(step)


def stuck_limit(timeout: float) -> float:
    """Seconds a storage call of a save may stay in flight before the watchdog ends the worker:
    the manager's ``timeout`` and a grace in which its own bound (``StuckWriteError``, polled every
    ``min(timeout / 4, 5)`` s) and the other ranks' round timeouts come first."""
    return timeout + min(timeout / 2, 30.0) + 5.0


@contextlib.contextmanager
def paused(timeout: float | None = None) -> Iterator[None]:
    """No hang is declared inside (``CheckpointManager`` wraps each save in it: a first save of a
    large state may outlast the timeout), except a storage call stuck for :func:`stuck_limit` of the
    manager's ``timeout``; timing restarts at its end."""
    wd = _HEART.watchdog if _HEART is not None else None
    if wd is None or wd._paused:  # paused already (restore's wait, close's suspend): stays so at the end
        yield
        return
    wd.pause(stuck_limit(timeout) if timeout is not None else None)
    try:
        yield
    finally:
        wd.resume()


def untimed(*names: str) -> Callable[[type], type]:
    """Class decorator of ``CheckpointManager``: methods ``names`` (``wait``, ``restore``) run :func:`paused`
    as a save does (a rollback's restore in the loop outlasting the hang timeout was a hang, exit 75)."""
    def wrap(cls: type) -> type:
        for name in names:
            def untimed_call(self: Any, *args: Any, _method: Any = getattr(cls, name), **kwargs: Any) -> Any:
                with paused(self.timeout or default_timeout()):
                    return _method(self, *args, **kwargs)
            setattr(cls, name, functools.wraps(getattr(cls, name))(untimed_call))
        return cls
    return wrap


def suspend() -> None:
    """No hang is declared until the next heartbeat (``CheckpointManager.close``: training is
    over, and evaluation or an upload may follow for longer than the timeout)."""
    if _HEART is not None and _HEART.watchdog is not None:
        _HEART.watchdog.pause()
