"""A stop signal to a script worker spares its DataLoader processes (``trainguard run``'s agent).

torch starts a script worker (not ``--run-path``) as the leader of a session of its own and
stops it with ``os.killpg``: on a restart (a worker failed, an agent joined or left) and on a
stop signal to the agent, the SIGTERM reached every process of the worker's group, its
DataLoader worker processes too. torch's handler in those ends them at once, and the training
process then raises ``RuntimeError: DataLoader worker ... is killed by signal: Terminated`` from
its SIGCHLD handler, anywhere in its step, before its ``CheckpointManager`` reaches the
preemption save it owes the signal: a scale-up or a SIGTERM to the agent (exit 143 all the same)
resumed from the last periodic checkpoint, or started afresh, where ``--run-path`` workers (torch
signals their pid only) saved. Found by the session-35 elastic audit.

A stop signal other than SIGKILL now goes to each process of the worker's group except the
children that a process *handling that signal* made with ``multiprocessing`` (a forked copy of its
parent, spawn/forkserver children, and theirs): the training process saves, exits and shuts its
loader down as usual, or is SIGKILLed with its whole group after ``--stop-timeout``. Everything
else is signalled as before: a wrapper's children (``--no-python bash train.sh``), and the loader
processes of a worker that does not handle the signal (it dies of it; they go with it). With
:func:`trainguard.ignore_stop_signals` as the loaders' ``worker_init_fn`` a signal sent to every
process (Slurm, Ctrl-C) spares them as well.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

# The command lines of multiprocessing's spawn and forkserver children, and of its helpers.
_MP_MARKS = (b"--multiprocessing-fork", b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def _proc(pid: int) -> tuple[int, int, bytes, int] | None:
    """``(parent pid, process group, command line, caught signals mask)`` of ``pid`` from ``/proc``,
    or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            caught = next((int(line.split()[1], 16) for line in f if line.startswith(b"SigCgt:")), 0)
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[2]), cmdline, caught


def stop_targets(pgid: int, sig: int) -> list[int]:
    """The processes of group ``pgid`` that the stop signal ``sig`` should reach: all but the
    ``multiprocessing`` children (a command line that is the parent's, forked without exec, or
    multiprocessing's own: spawn, forkserver), and theirs, of a process of the group that catches
    ``sig`` (a DataLoader's workers under a training process that saves on the signal)."""
    group: dict[int, tuple[int, bytes, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := _proc(int(name))) is not None and info[1] == pgid:
            group[int(name)] = (info[0], info[2], info[3])

    def made_by_mp(pid: int) -> bool:
        ppid, cmd, _ = group[pid]
        return ppid in group and (cmd == group[ppid][1] or any(m in cmd for m in _MP_MARKS))

    def spared(pid: int) -> bool:
        owner, hops = pid, 0
        while made_by_mp(owner) and hops < 64:  # up to the process that is no multiprocessing child
            owner, hops = group[owner][0], hops + 1
        return owner != pid and bool(group[owner][2] >> (int(sig) - 1) & 1)

    return sorted(pid for pid in group if not spared(pid))


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to the group's processes :func:`stop_targets` names (the leader at least)."""
    for pid in stop_targets(pgid, sig) or [pgid]:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def install(handler_cls: Any) -> None:
    """Agent (``reap.bound_failure_close``): torch's ``SubprocessHandler.close`` sends a stop signal
    by :func:`signal_group`; SIGKILL still goes to the whole group (``os.killpg``)."""
    if getattr(handler_cls, "_tg_spares", False) or not hasattr(os, "killpg"):
        return
    orig_close = handler_cls.close

    def close(self: Any, death_sig: Any = None) -> None:
        proc, sig = getattr(self, "proc", None), signal.SIGTERM if death_sig is None else death_sig
        if sig == signal.SIGKILL or proc is None or proc.poll() is not None:
            try:
                return orig_close(self, death_sig)
            except ProcessLookupError:
                # The group is gone: its leader exited after torch's ``_close`` polled it (still
                # running) and the poll() above reaped it. torch's killpg raised out of the agent,
                # which ended with ``error: No such process`` (exit 2) instead of the workers' 143.
                pass
        else:
            signal_group(proc.pid, int(sig))
        for stream in (getattr(self, "_stdout", None), getattr(self, "_stderr", None)):
            if stream:  # what torch's close does after its killpg
                stream.close()

    handler_cls.close = close
    handler_cls._tg_spares = True
