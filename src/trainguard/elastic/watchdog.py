"""Per-worker progress heartbeat, hang watchdog and orphan check.

The training loop reports progress once per step: :meth:`CheckpointManager.save` calls
:func:`heartbeat` for you, or call ``tg.elastic.heartbeat(step)`` yourself. Each call, on
every rank, in this order: (1) rank 0 appends a ``step`` event to the run's event log (and,
on its first call in this process, a ``first_step`` event with the steps lost since the last
run of the job); (2) the watchdog notes the time; (3) any fault drill for this rank and step
fires (:mod:`.faults`).

The watchdog is a daemon thread, started by the first heartbeat when ``TRAINGUARD_WATCHDOG=1``
(``trainguard run`` sets it). It ends the worker with exit code 75 when

* no heartbeat came for longer than the timeout: ``TRAINGUARD_HANG_TIMEOUT`` seconds if set,
  else ``max(floor, factor * longest of the last 50 gaps)`` (floor ``TRAINGUARD_HANG_FLOOR``,
  default 60 s; the watchdog is armed at the first heartbeat, so imports, rendezvous and
  restore are not timed). It first dumps every thread's Python stack (faulthandler) to
  stderr and to ``<run dir>/hang-rank<R>-<pid>.txt``, and logs a ``hang`` event. A rank
  blocked in a collective because its peer died or hangs stops beating too, so it is covered:
  gloo has no watchdog of its own.
* its parent (the elastic agent) died: an orphaned worker would otherwise keep training and
  hold its peers in collectives (``orphaned`` event, exit code 76).

The thread only reads a clock and ``os.getppid()``; gloo waits release the GIL, so it runs
while the main thread is blocked in a collective.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

from ..events import EVENTS_FILE, EventLog, read_events
from .faults import Fault, faults_from_env, maybe_fire, run_dir

HANG_EXIT = 75
ORPHAN_EXIT = 76


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
        self.events = events or EventLog(None)
        self.dump_dir = dump_dir
        self._last: float | None = None
        self._paused = False
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

    def pause(self) -> None:
        """Stop timing (a save in progress, training over) until :meth:`resume` or the next beat."""
        self._paused = True

    def resume(self) -> None:
        """Time again from now; the paused time is no gap between steps."""
        if self._paused:
            self._last, self._paused = time.monotonic(), False

    def current_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        longest = max(self._gaps, default=0.0)
        return max(self.floor, self.factor * longest)

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.events.emit("orphaned", parent_pid=self.parent_pid)
                print(f"trainguard: agent (pid {self.parent_pid}) is gone; this worker exits", file=sys.stderr)
                os._exit(ORPHAN_EXIT)
            last = self._last
            if last is not None and not self._paused and time.monotonic() - last > self.current_timeout():
                self._on_hang(time.monotonic() - last)

    def _on_hang(self, idle: float) -> None:
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
        print(
            f"trainguard: no progress for {idle:.1f} s (timeout {self.current_timeout():.1f} s, last step "
            f"{self._step}) on rank {self.events.rank}; Python stacks follow, then the worker exits",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self.events.emit(
            "hang", step=self._step, idle_s=round(idle, 3), timeout_s=round(self.current_timeout(), 3),
            stacks=stacks[-20000:],
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
        self.first = True
        self.watchdog: Watchdog | None = None
        if os.environ.get("TRAINGUARD_WATCHDOG") == "1":
            t = os.environ.get("TRAINGUARD_HANG_TIMEOUT")
            self.watchdog = Watchdog(
                timeout=float(t) if t else None,
                floor=float(os.environ.get("TRAINGUARD_HANG_FLOOR", "60")),
                parent_pid=os.getppid(),
                events=self.events,
                dump_dir=rd,
            ).start()

    def beat(self, step: int) -> None:
        if self.rank == 0 and self.events.path is not None:
            if self.first:
                self.events.emit("first_step", step=step, world_size=self.world_size,
                                 lost_steps=_lost_steps(self.events.path, step))
            self.events.emit("step", step=step, world_size=self.world_size)
        self.first = False
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.faults:
            maybe_fire(step, self.rank, self.faults)


def _lost_steps(path: os.PathLike[str] | str, step: int) -> int:
    """Steps done by an earlier run of the job beyond the one this run resumed from."""
    last = None
    for ev in read_events(path):
        if ev.get("event") == "step":
            last = ev.get("step")
    if last is None or last < step:
        return 0
    return int(last) - (step - 1)


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


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No hang is declared inside (``CheckpointManager`` wraps each save in it: a first save of a
    large state may outlast the timeout); timing restarts at its end."""
    wd = _HEART.watchdog if _HEART is not None else None
    if wd is None:
        yield
        return
    wd.pause()
    try:
        yield
    finally:
        wd.resume()


def suspend() -> None:
    """No hang is declared until the next heartbeat (``CheckpointManager.close``: training is
    over, and evaluation or an upload may follow for longer than the timeout)."""
    if _HEART is not None and _HEART.watchdog is not None:
        _HEART.watchdog.pause()
