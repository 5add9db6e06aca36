"""Fault drills: kill, exit, raise or hang one worker at one step, once per job.

``trainguard run --fault "step=743,rank=1,kind=kill"`` (repeatable) or, under plain torchrun,
``TRAINGUARD_FAULT="step=743,rank=1,kind=kill"`` (several specs separated by ``;``).
:func:`maybe_fire` is called by :func:`trainguard.elastic.heartbeat` on every rank at every
step; the matching rank fires. "Once per job": before firing, the rank creates a marker file
with ``O_EXCL`` under ``<run dir>/.trainguard/`` named after the job id (:func:`job_id`: the
rendezvous id ``TORCHELASTIC_RUN_ID``), so the restarted workers, which see the same step again,
do not fire again, while a new job in the same run directory does.

Kinds: ``kill`` (SIGKILL to itself: no cleanup, like an OOM kill), ``exit`` (``os._exit(43)``),
``exception`` (raises :class:`InjectedFault` from the training loop), ``hang`` (blocks forever,
for the hang watchdog to find), ``agent`` (SIGKILL to its elastic agent, then to itself: the
loss of a whole node, for world-size drills). The agent is the pid ``trainguard run`` exports as
``TRAINGUARD_AGENT_PID`` (with ``--start-method forkserver`` the worker's parent is the
forkserver, not the agent), else the parent (plain torchrun).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass

from ..errors import CheckpointError
from ..events import EVENTS_FILE, EventLog
from . import reap

KINDS = ("kill", "exit", "exception", "hang", "agent")
ENV = "TRAINGUARD_FAULT"
EXIT_CODE = 43


class FaultSpecError(CheckpointError, ValueError):
    """A ``--fault`` / ``TRAINGUARD_FAULT`` spec that cannot be parsed."""

    permanent = True


class InjectedFault(RuntimeError):
    """Raised by a ``kind=exception`` drill. A RuntimeError, not a CheckpointError, so that code
    catching trainguard's errors does not swallow the simulated crash."""


@dataclass(frozen=True)
class Fault:
    """One drill: fire on global ``rank`` when the heartbeat reports ``step``."""

    step: int
    rank: int = 0
    kind: str = "kill"

    def spec(self) -> str:
        return f"step={self.step},rank={self.rank},kind={self.kind}"


def parse_fault(text: str) -> Fault:
    """``"step=743,rank=1,kind=kill"`` -> :class:`Fault` (rank defaults to 0, kind to kill)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("step", "rank", "kind"):
            raise FaultSpecError(f"fault spec {text!r}: expected step=N,rank=R,kind=K; cannot read {part!r}")
        fields[key.strip()] = value.strip()
    if "step" not in fields:
        raise FaultSpecError(f"fault spec {text!r}: step=N is required, e.g. 'step=743,rank=1,kind=kill'")
    kind = fields.get("kind", "kill")
    if kind not in KINDS:
        raise FaultSpecError(f"fault spec {text!r}: kind must be one of {', '.join(KINDS)}")
    try:
        step, rank = int(fields["step"]), int(fields.get("rank", "0"))
    except ValueError:
        raise FaultSpecError(f"fault spec {text!r}: step and rank must be integers") from None
    if step < 0 or rank < 0:
        raise FaultSpecError(f"fault spec {text!r}: step and rank must be >= 0")
    return Fault(step=step, rank=rank, kind=kind)


def faults_from_env(environ: os._Environ[str] | dict[str, str] | None = None) -> list[Fault]:
    env = os.environ if environ is None else environ
    return [parse_fault(s) for s in env.get(ENV, "").split(";") if s.strip()]


def run_dir() -> str | None:
    """The run directory ``trainguard run --run-dir`` passed to the workers, if any."""
    return os.environ.get("TRAINGUARD_RUN_DIR") or None


def job_id() -> str:
    """The id of this job for fault markers: the rendezvous id, the same on every node; torchrun's
    default rendezvous id ("none", multi-node without --rdzv-id) names no job, so then the id
    ``trainguard run`` made for this launch, else (plain torchrun) this node's agent process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    return os.environ.get("TRAINGUARD_JOB_ID") or f"agent-{socket.gethostname()}-{os.getppid()}"


def _marker(fault: Fault) -> str:
    job = job_id()
    base = run_dir() or os.path.join(tempfile.gettempdir(), "trainguard-faults")
    digest = hashlib.sha1(f"{job}|{fault.spec()}".encode()).hexdigest()[:16]
    return os.path.join(base, ".trainguard", f"fault-{digest}.fired")


def claim(fault: Fault) -> bool:
    """Create the fault's marker; True only for the first caller in this job."""
    path = _marker(fault)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{fault.spec()} pid={os.getpid()} t={time.time()}\n".encode())
    os.fsync(fd)  # durable before the process dies, or the restarted worker would fire again
    os.close(fd)
    return True


def fired(fault: Fault) -> bool:
    """Whether ``fault`` fired in this job already (its marker exists). The heartbeat's warning about a
    drill naming a rank the job lacks is then moot: ``kind=agent`` on rank 1 of 2 shrank the job to 1
    rank, and the survivor warned that the drill "does not fire" and to name another rank."""
    return os.path.exists(_marker(fault))


def maybe_fire(step: int, rank: int, faults: list[Fault]) -> None:
    """Fire every fault of this rank and step that has not fired in this job yet."""
    for f in faults:
        if f.step != step or f.rank != rank or not claim(f):
            continue
        rd = run_dir()
        EventLog(os.path.join(rd, EVENTS_FILE) if rd else None, rank=rank).emit(
            "fault", step=step, kind=f.kind, spec=f.spec()
        )
        fire(f)


def fire(f: Fault) -> None:
    """Carry out ``f`` in this worker (:func:`maybe_fire`, on the rank it names)."""
    if f.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "exit":
        os._exit(EXIT_CODE)
    elif f.kind == "exception":
        raise InjectedFault(f"injected fault: {f.spec()}")
    elif f.kind == "agent":
        from .watchdog import _agent_pid  # not at the top: watchdog imports this module

        agent = _agent_pid()  # under forkserver the parent is the forkserver, which would not end the agent
        os.kill(agent if agent is not None else os.getppid(), signal.SIGKILL)
        reap.end_children()  # its DataLoader processes end with it, as on a lost node (they lived ~5 s on)
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "hang":
        _injected_hang()


def _injected_hang() -> None:
    while True:  # the hang watchdog dumps this frame and ends the process
        time.sleep(0.5)
