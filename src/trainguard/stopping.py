"""How a ``CheckpointManager`` stops and decides, every step, on every rank alike: its stop-signal handler,
the chaining of managers' handlers, and the per-step "decide" round that carries a stop to every rank.

Moved out of ``policies.py``, which re-exports every name here (its callers use ``policies.<name>``):

- ``CheckpointManager.save``, every rank, each step: :func:`decide` (rank 0's save/stop decision, broadcast),
  :func:`decision_mark` before a save starts, and :func:`forget_decisions` (rank 0) once it committed.
- ``CheckpointManager._on_signal`` (main thread, the SIGTERM/SIGINT/SIGHUP handler ``open()`` installs):
  :func:`on_stop_signal`, which tells a manager opened before it (:func:`chain_preemption`).
- ``CheckpointManager.close`` in the main thread, and ``forks`` in a forked child: :func:`unchain_handlers`.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from .dist import DistContext
from .distwait import forget_passed


def decide(ctx: DistContext, want: bool, preempt: bool, timeout: float | None) -> tuple[bool, bool]:
    """``CheckpointManager.save`` on every rank, each step of a distributed run: rank 0's
    ``(save now, stop now)``, broadcast. The stop is asked by *any* signalled rank: a rank whose
    flag is set writes a store key, which rank 0 looks at (one ``check``) before it decides;
    before, only rank 0's own flag counted, and a SIGTERM that reached another node's workers
    (its node reclaimed) was never acted on. A rank that sets the key at step k, after rank 0
    decided step k, is heard at step k+1: every rank still receives the same decision."""
    if ctx.is_distributed:
        try:
            if preempt and ctx.rank != 0:
                ctx.raise_flag("preempt")
            elif ctx.rank == 0 and not preempt:
                preempt = ctx.flag_raised("preempt")
        except Exception:  # a store that stopped answering: the broadcast below says so, on every rank
            pass
    out = ctx.broadcast("decide", [bool(want), preempt], timeout=timeout)
    try:
        forget_passed(ctx)  # rank 0: the keys of the decisions every rank has read
    except Exception:  # a store that stopped answering: the next round says so
        pass
    return bool(out[0]), bool(out[1])


def decision_mark(ctx: DistContext) -> int | None:
    """The round of ``ctx`` (the manager's main channel) that this step's decision was read in,
    taken before the step's save starts: :func:`forget_decisions` after that save commits."""
    return ctx.mark()


def forget_decisions(ctx: DistContext, mark: int | None) -> None:
    """Rank 0, once the save started after main-channel round ``mark`` committed: every rank
    reached that save's "begin" round, so every rank has read the rounds up to ``mark`` (the
    per-step "decide" broadcasts): their store keys are deleted. Only a gather deletes old rounds
    of a channel, and an async save gathers on its own channel: without this the main channel
    kept one store key per training step (and rank 0 one record) for the whole run."""
    ctx.forget(mark)


def on_stop_signal(mgr: Any, signum: int, frame: Any) -> None:
    """``CheckpointManager._on_signal``, the SIGTERM/SIGINT/SIGHUP handler its ``open()`` installs (Python
    runs it in the main thread): only set a flag (a handler that blocks, e.g. in a collective, stalls
    torchrun's shutdown) and tell a manager opened before it (:func:`chain_preemption`). A manager
    closed in another thread (where Python refuses to set handlers) left it installed: it then puts
    back the handlers its ``open()`` replaced and hands them the signal, as if it had been closed in
    the main thread (Ctrl-C raises ``KeyboardInterrupt``, SIGTERM ends the process). Before, every
    later SIGTERM and Ctrl-C set a flag that no open manager read: the process ignored them."""
    old = mgr._old_handlers  # a None in it (set outside Python) cannot be put back: the flag, as before
    if not mgr._opened and old and None not in old.values() and signal.getsignal(signum) == mgr._on_signal:
        previous = old.get(signum)
        unchain_handlers(mgr._on_signal, old)
        if previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # its default action, now that the default is installed again
        elif callable(previous):
            previous(signum, frame)  # Python's default_int_handler raises KeyboardInterrupt here
        return
    # The first stop signal, except torch's parent-death SIGINT (PR_SET_PDEATHSIG: a dead forkserver, or the agent
    # of a forked worker, when this process's parent changed since open()): any other one wins over it, whichever
    # came first. Python runs the handlers of signals pending together lowest number first (SIGINT before
    # SIGTERM): a SIGTERM to every process of a forkserver job that came while the main thread waited in a
    # collective was handled after the dead forkserver's SIGINT, and the worker's exit code was 130, not 143.
    dead_parent = signum == signal.SIGINT and os.getppid() != getattr(mgr, "_ppid", os.getppid())
    if not mgr._signum or (getattr(mgr, "_signum_dead_parent", False) and not dead_parent):
        mgr._signum, mgr._signum_dead_parent = signum, dead_parent
    mgr._preempt.set()
    chain_preemption(mgr._old_handlers.get(signum), signum, frame)


def chain_preemption(previous: Any, signum: int, frame: Any) -> None:
    """Called by a ``CheckpointManager``'s SIGTERM/SIGINT handler with the handler its ``open()``
    replaced: when that is another open manager's (two managers in one process, e.g. the model's
    and an EMA copy's), it is told too, so that every open manager saves at its next ``save()`` and
    sets ``should_stop``, not only the one opened last. Any other handler is not called."""
    if getattr(previous, "__name__", None) == "_on_signal" and hasattr(getattr(previous, "__self__", None), "_preempt"):
        previous(signum, frame)


def unchain_handlers(mine: Any, old: dict[int, Any]) -> None:
    """``CheckpointManager.close`` in the main thread: put back, for each signal, the handler its
    ``open()`` replaced (``old``, emptied here). When another manager opened later is still open, its
    handler is the one installed, and it holds ``mine`` as the handler to chain to: ``mine`` is then
    taken out of that chain instead (its predecessor becomes ``old[sig]``). Restoring ``old[sig]``
    over it, as before, left the later manager deaf to signals, and its own ``close()`` then put this
    closed manager's handler back for good: SIGTERM and Ctrl-C only set a flag nobody read."""
    for sig, previous in old.items():
        current = signal.getsignal(sig)
        owner, seen = getattr(current, "__self__", None) if current != mine else None, set()
        while owner is not None and isinstance(getattr(owner, "_old_handlers", None), dict) and id(owner) not in seen:
            seen.add(id(owner))
            nxt = owner._old_handlers.get(sig)
            if nxt == mine:
                owner._old_handlers[sig] = previous
                break
            owner = getattr(nxt, "__self__", None)
        else:
            signal.signal(sig, previous)
    old.clear()
