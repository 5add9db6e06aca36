"""A dead worker whose children live on is still seen dead at once (``trainguard run``'s agent).

torch's agent (function entrypoints: ``--run-path``) learns that a worker ended from its process
*sentinel*, a pipe whose write end the worker holds. A worker's DataLoader processes (forked from
it) hold that end too, so a worker SIGKILLed or OOM-killed was seen dead only when its loader
workers ended: torch's loader watchdog notices a dead parent within 5 s (5.1-5.2 s measured by
the chaos review, 3 of 4 kills; 0.03-0.08 s without loader workers). The agent polls its workers
every ``--monitor-interval`` through ``ProcessContext.join``; before each, :func:`expose_dead`
asks each worker's exit status (``waitpid(WNOHANG)``, as ``Process.exitcode`` does) and gives a
worker that has ended a sentinel that is ready, so torch's ``join`` handles it at once.

Those loader processes also outlived the agent: torch's agent ends a ``--run-path`` worker by its
pid only, so a SIGKILLed worker's loader processes (reparented to pid 1) lived on after the agent
had exited, holding its stdout open. Each such worker now leads a session of its own
(:func:`own_session`, as torch starts a script worker: ``start_new_session=True``), and after
torch closed the workers the agent SIGKILLs what is left of each worker's group (:func:`end_trees`).

Those loader processes, forked after ``init_process_group``, also hold copies of the worker's gloo
sockets: its peers' collectives saw no closed connection while they lived, and waited, blocked,
for the agent's SIGKILL after the failure grace (1 s; torch's loader watchdog, ~5 s, without
``trainguard run``): a kill's "detect" took 1.1-1.3 s instead of 0.3 s (a small GPT with 2 loader
workers per rank). So as soon as the agent sees a worker failed (:func:`expose_dead` for
``--run-path`` workers, :func:`bound_failure_close` for script workers) it SIGKILLs what is left
of that worker's group, and the peers' collectives fail at once: they exit with their own error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any


def expose_dead(pc: Any) -> list[int]:
    """Agent, in its ``ProcessContext.join`` hook, before torch's ``join``: the ended workers of
    ``pc`` whose sentinel is still open get a ready one instead. Returns the descriptors made here,
    for :func:`close_done` after the ``join``."""
    made = []
    for sentinel, index in list(pc.sentinels.items()):
        if (code := pc.processes[index].exitcode) is None:  # alive (poll: waitpid WNOHANG)
            continue
        if code != 0:  # failed: its loader processes hold its gloo sockets too (module docstring)
            end_trees([pc.processes[index].pid])
        r, w = os.pipe()
        os.close(w)  # read end at EOF: ready for multiprocessing.connection.wait
        del pc.sentinels[sentinel]
        pc.sentinels[r] = index
        made.append(r)
    return made


def close_done(pc: Any, made: list[int]) -> list[int]:
    """Agent, after torch's ``join``: close the descriptors of :func:`expose_dead` that ``join``
    took out of ``pc.sentinels`` (it handled their workers); returns those it still holds."""
    left = []
    for fd in made:
        if fd in pc.sentinels:
            left.append(fd)
        else:
            with contextlib.suppress(OSError):
                os.close(fd)
    return left


def close_ready(pc: Any) -> None:
    """Agent, in its ``MultiprocessContext._close`` hook, after torch's close: close the descriptors of
    :func:`expose_dead` that torch's ``join`` left in ``pc.sentinels`` (it stops at the first failed worker it
    finds; an ended peer's stays). Before, each such descriptor was left open when the context was dropped: the
    agent's open descriptors grew with its restarts, one per failure that found both of 2 ``--run-path`` workers
    ended (28 to 37 in 10 restarts, a ``gc.collect()`` before each count; review55a)."""
    for fd in getattr(pc, "_tg_ready", None) or []:
        pc.sentinels.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)
    if getattr(pc, "_tg_ready", None):
        pc._tg_ready = []


def own_session() -> None:
    """A ``--run-path`` worker, first (:func:`trainguard.permanent.run_script_path`): a session
    and process group of its own, which its DataLoader processes inherit, so that the agent ends
    the worker's whole process tree with one ``killpg`` (:func:`end_trees`). A new session, not
    only a group: no background group of the terminal (a ``breakpoint()`` reading stdin works)."""
    with contextlib.suppress(OSError):  # already a group leader: not a forked worker
        os.setsid()


def threads_from_env() -> None:
    """A ``--run-path`` worker, first (:func:`trainguard.permanent.run_script_path`): torch's intra-op
    thread count as ``OMP_NUM_THREADS`` says (torchrun sets 1 for each of several workers), as a script
    or spawned worker has it. A worker forked from the agent (``--start-method fork``, the demo's) kept
    the thread count of the agent's torch, imported before: 2 threads per worker on this 2-core machine
    with ``OMP_NUM_THREADS=1`` (plain torchrun too), so two ranks ran 4 threads on 2 cores, and the
    same job's losses differed from step 3 on from those of its script workers (bit-identical resumes
    need the same numerics as the run that saved)."""
    import sys

    n = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")  # forked from the agent, or from the forkserver: imported already
    if torch is not None and n.isdigit() and int(n) > 0 and torch.get_num_threads() != int(n):
        torch.set_num_threads(int(n))


def end_trees(pids: list[int]) -> None:
    """Agent, after torch's ``MultiprocessContext._close`` stopped (or found dead) the workers
    ``pids``: SIGKILL whatever is left in their process groups (loader processes)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) != pid:  # a live worker that is no group leader: not ours to group-kill
                continue
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def end_children() -> None:
    """A worker's watchdog (:mod:`.watchdog`) as it exits orphaned (its agent died): SIGKILL its
    ``multiprocessing`` children (DataLoader workers). ``os._exit`` skips the loader's shutdown, and
    no agent is left to SIGKILL the worker's group (:func:`end_trees`): they lived on until torch's
    loader watchdog saw their parent gone (~5 s), holding the job's stdout and stderr open."""
    import multiprocessing

    with contextlib.suppress(Exception):
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()


def set_finished(event: Any, wait: float) -> None:
    """Agent, in its ``MultiprocessContext._close`` hook: set torch's "workers finished" event, which
    a worker whose function returned waits for and torch sets only when all are done, never on
    close (one that saved on SIGTERM and returned waited for SIGKILL: 30 s on SIGTERM to the agent,
    --stop-timeout on a restart); waiting at most ``wait`` s. It is a ``multiprocessing.Event``:
    its ``set()`` waits until every process sleeping in ``wait()`` has woken
    (``multiprocessing.Condition.notify``): a worker whose function returned sleeps there, and one
    killed there (SIGTERMed or SIGKILLed after a peer failed) never wakes: the agent hung for good in ``set()``. It runs in a thread; after ``wait`` the agent goes on
    (torch closes the workers twice on a failure: the second close does not wait again)."""
    if getattr(event, "_tg_setter", None) is not None:
        return
    event._tg_setter = setter = threading.Thread(target=event.set, name="trainguard-finished", daemon=True)
    setter.start()
    setter.join(wait)


class _Returned:
    """Stands in, in a ``--run-path`` worker, for torch's "workers finished" event (:func:`worker_wrap`)."""

    def wait(self, timeout: float | None = None) -> bool:
        return True


def worker_wrap(local_rank: int, fn: Any, *args: Any) -> Any:
    """A function worker's body (``--run-path``): torch's ``_wrap`` (std redirects, error file, the
    return value put on its queue), installed by :func:`exit_when_returned`, except that a worker
    whose script returned then exits, as a script worker's process does. torch's ``_wrap`` waits
    for an event the agent sets only when every worker is done, so a rank whose script returned
    early (its loop ended at step 5, the others' at 20) kept its process, and with it its gloo
    connections and, on rank 0, the job's c10d store: the other ranks blocked in DDP's all-reduce
    until the hang watchdog (60 s floor), which named a rank hung (exit 75, either one). Script
    workers: the peer fails in ~2.5 s (gloo: connection closed by peer). ``destroy_process_group``
    after the script does not close them: once a DDP module was built, the gloo pairs outlive the
    default group. ``run_script_path`` returns None (no CUDA tensor whose producer must live on)."""
    from torch.distributed.elastic.multiprocessing import api

    from ..permanent import run_script_path

    torch_wrap = getattr(api, "_tg_torch_wrap", api._wrap)  # forked worker: the agent's patched module
    if torch_wrap is worker_wrap:
        raise RuntimeError("trainguard: torch's worker wrapper not found")
    if fn is run_script_path:
        import inspect

        names = list(inspect.signature(torch_wrap).parameters)
        if "queue_finished_reading_event" in names:  # (local_rank, fn, ...) in torch 2.x
            i = names.index("queue_finished_reading_event") - 2
            if 0 <= i < len(args):
                args = (*args[:i], _Returned(), *args[i + 1:])
    return torch_wrap(local_rank, fn, *args)


def exit_when_returned() -> None:
    """Agent (``launcher.install_agent_hooks``): torch's ``MultiprocessContext`` starts its workers
    with :func:`worker_wrap`, not its ``_wrap`` (spawn and forkserver workers import it by name)."""
    from torch.distributed.elastic.multiprocessing import api

    if api._wrap is not worker_wrap:
        api._tg_torch_wrap = api._wrap  # type: ignore[attr-defined]
        api._wrap = worker_wrap


def stop_bounded(agent: Any, timeout: int, *args: Any, **kwargs: Any) -> None:
    """Agent, in its ``_stop_workers`` hook (a restart, the end of a failed attempt): torch's
    ``_shutdown``, which SIGTERMs the workers, with SIGKILL ``timeout`` s later. ``args`` and
    ``kwargs``: what torch passed to ``_stop_workers`` besides the worker group, passed on.

    torch 2.13's ``_shutdown`` takes ``timeout``. torch 2.11's does not: passing it raised
    ``TypeError`` and every restart ended the agent (seen on a GPU machine with that torch). With
    such a torch the workers are closed here first, with ``timeout``; its ``_shutdown`` then
    finds them ended and stops the rest (watchdog, health check).

    A membership restart (an agent joined or left; the launcher's ``_restart`` hook sets
    ``_tg_membership``) stops healthy workers, which finish their step and commit a preemption save
    (``handle_signals``): they get torch's shutdown timeout (``--shutdown-timeout``, 30 s), as on a
    SIGTERM to the agent, when it is longer. ``timeout`` (``--stop-timeout``, 5 s) SIGKILLed a worker
    whose step and save took longer, and the restart resumed from the last periodic checkpoint."""
    import inspect

    if getattr(agent, "_tg_membership", False):
        timeout = max(timeout, int(getattr(agent, "_shutdown_timeout", timeout) or timeout))
    if "timeout" in inspect.signature(agent._shutdown).parameters:
        agent._shutdown(*args, timeout=timeout, **kwargs)
        return
    pcontext = getattr(agent, "_pcontext", None)
    if pcontext is not None:
        pcontext.close(signal.SIGTERM, timeout)
    agent._shutdown(*args, **kwargs)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is no zombie), from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_orphans(pids: list[int], signalled: set[int], sig: int, timeout: float) -> None:
    """Agent, in its ``MultiprocessContext._close`` hook, after torch's close and before
    :func:`end_trees`: workers ``pids`` that still run get ``sig`` (those torch had not signalled:
    not in ``signalled``) and ``timeout`` s to end, their preemption save. With ``--start-method
    forkserver`` a SIGTERM to every process of the job killed the forkserver: its children then
    read as ended (code 255), torch's close waited for none, and ``end_trees`` SIGKILLed them mid-save."""
    left = [pid for pid in pids if running(pid)]
    for pid in left:
        if pid not in signalled:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
    end = time.monotonic() + timeout
    while left and time.monotonic() < end:  # bounded by timeout
        time.sleep(0.05)
        left = [pid for pid in left if running(pid)]


def bound_failure_close(context_cls: Any, grace: float) -> None:
    """Agent (``launcher.install_agent_hooks``): torch's script workers (``SubprocessContext``; not
    ``--run-path``) are closed by its ``_poll`` with a fixed 30 s once one failed, so a peer that
    does not end on SIGTERM (stopped, in a C call, or saving on the signal while its collectives
    wait for the dead peer) held the restart for 30 s. That close now waits ``grace`` s, as for
    function workers; not when every failure is an exit after a stop signal's save (the others
    may still be closing theirs), nor the agent's own closes (a stop signal to the agent). A stop
    signal no longer reaches the DataLoader processes of a worker that handles it (:mod:`.spare`)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    from . import agentsig, spare, stops
    from .stops import STOP_CODES

    spare.install(SubprocessHandler)  # a stop signal spares the worker's DataLoader processes (spare.py)
    orig_poll, orig_close = context_cls._poll, context_cls._close

    def _poll(self: Any) -> Any:
        self._tg_polling = True
        try:
            return orig_poll(self)
        finally:
            self._tg_polling = False

    def _close(self: Any, death_sig: Any, timeout: int = 30) -> None:
        codes = [f.exitcode for f in getattr(self, "_failures", {}).values()]
        failed = getattr(self, "_tg_polling", False) and codes and not all(c in STOP_CODES for c in codes)
        stops.AGENT_STOPPED.clear()  # every close: no pid of an earlier round's workers stays (a pid may be reused)
        if failed:  # the workers still running now are stopped by the agent: not the failure's cause
            handlers = list(getattr(self, "subprocess_handlers", {}).values())
            stops.AGENT_STOPPED.update(h.proc.pid for h in handlers if h.proc.poll() is None)
            end_trees([h.proc.pid for h in handlers if h.proc.poll() is not None])  # end_dead: peers fail at once
        with agentsig.deferred(bool(failed)):  # a stop signal now: after this close and the failure event
            orig_close(self, death_sig, min(timeout, max(1, round(grace))) if failed else timeout)
        # torch signals only the groups of workers still running: those of a worker that had exited
        # (a hang's or orphan's os._exit, a SIGKILL) kept their DataLoader processes after the agent.
        end_trees([h.proc.pid for h in getattr(self, "subprocess_handlers", {}).values()])

    context_cls._poll, context_cls._close = _poll, _close
