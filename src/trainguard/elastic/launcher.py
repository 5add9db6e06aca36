"""``trainguard run``: torch's elastic agent (``torch.distributed.run``) with trainguard's defaults, fault drills, hang watchdog, event log.

Called once per node by ``trainguard run`` (:func:`main`); this process *is* the elastic agent, as ``torchrun`` would be (its parser plus trainguard's options). Before the agent starts it:

* sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with torch's default, restarted workers may connect to the dead
  attempt's gloo ports: recovery failed 3 times in 6 here), the workers' ``MASTER_PORT`` held for them (:mod:`.masterport`);
* adds ``last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3`` to the c10d
  ``--rdzv-conf`` (scale-down in ~10 s instead of 46 s); values you pass win;
* defaults ``--max-restarts`` to 3 (torchrun: 0);
* stops workers on a restart with SIGTERM, then SIGKILL after ``--stop-timeout`` (5 s; torch: 30 s; a membership restart: ``--shutdown-timeout`` when longer);
  a worker that returned on that SIGTERM (a preemption save) exits at once (torch: waits for SIGKILL),
  as does a ``--run-path`` worker whose script returned (torch: gloo open until all end, :func:`.reap.worker_wrap`);
* on a worker failure, gives the other workers 1 s, SIGTERM, 1 s, then SIGKILL (torch: SIGTERM
  and a fixed 30 s; script and ``--run-path`` workers), and sets ``TRAINGUARD_DEAD_AFTER=3`` for the workers (store default 10 s);
* preformats tracebacks for torch's log formatter (it imports ``torch._dynamo``, ~2 s) and, with ``fork``/``forkserver``, preloads it so restarted workers do not (:func:`preload`);
* defaults ``--log-dir`` to a temp directory removed at its exit (torch: a ``torchelastic_*`` directory kept in the temp directory) and removes the workers' ``pytorch-errorfile-*`` files at each close (:mod:`.errfiles`);
* passes ``TRAINGUARD_RUN_DIR``, ``_WATCHDOG``, ``_HANG_TIMEOUT``, ``_FAULT``, ``_JOB_ID``, ``_AGENT_PID`` (orphan check), ``_STOP_FILE``;
* wraps the agent's rendezvous/monitor/restart methods *in this process only* to log events to
  ``<run dir>/events.jsonl`` and to end a job its workers stopped on a stop signal (:mod:`.stops`;
  the wrappers: :func:`.agenthooks.install_agent_hooks`).

On SIGTERM, SIGINT, SIGHUP or SIGQUIT torch's agent stops its workers with that signal and raises ``SignalException``
(once: :func:`.agentsig.install_signal_once`, from the agent's start: :func:`.agentsig.install_early`); :func:`main` logs
``agent_exit``, stops the rendezvous keep-alive thread (:mod:`.keepalive`) and returns 128 + the signal (143 for SIGTERM;
torchrun: a traceback, exit 1), as when the workers alone were stopped so. When the main thread is inside a C++ call that
does not return on a signal (a store connect or wait), :mod:`.sigwatch` does the same from a thread (``exit_stuck``).
torch's exit barrier is waited in short waits and ends when the agents it waits for are gone (:mod:`.exitbarrier`).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import uuid

from ..events import EVENTS_FILE, EventLog
from . import agentsig, errfiles, keepalive, sigwatch
from . import args as cli_args
from .agenthooks import AGENT, FAIL_GRACE, RESTARTS, install_agent_hooks  # noqa: F401  (moved there; tests use launcher.install_agent_hooks)
from .agentsig import install_early, install_signal_once  # noqa: F401  (install_signal_once: tests import it here)
from .faults import parse_fault
from .stops import (
    STOP_FILE_ENV,
    agent_result,
    clear,
    quiet_stop,
    root_failure,  # noqa: F401  (tests import it here)
    stop_file,
)
from .watchdog import AGENT_PID_ENV

DEAD_AFTER = 3.0
RDZV_DEFAULTS = {"last_call_timeout": "3", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}

DEFAULTS_TEXT = """\
trainguard run = torchrun + fault drills + hang watchdog + event log. Every torchrun flag works.
Defaults that differ from torchrun (each fixes a measured trap; override any of them):
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  restarted workers get a fresh store (torch's shared one
                                        makes restarts fail on stale gloo ports)
  --rdzv-conf last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3
                                        c10d: a lost agent is noticed in seconds (46 s otherwise);
                                        heartbeats judged by each agent's clock (nodes' clocks may differ)
  --max-restarts 3                      torchrun: 0
  --stop-timeout 5                      SIGKILL workers 5 s after SIGTERM on a restart (torch: 30 s);
                                        a worker that returned on SIGTERM (preemption save) exits
                                        at once (torch: waits for the SIGKILL)
  worker failure -> peers SIGKILLed    after 1 s + SIGTERM + 1 s (torch: SIGTERM, then 30 s)
  --monitor-interval 0.1                torch's default here (the agent polls its workers 10x/s)
  TRAINGUARD_DEAD_AFTER=3               workers: a peer without store heartbeat for 3 s is dead
                                        (default 10): bounds a survivor's wait on a save in flight
  torch._dynamo preloaded (fork)        forked workers skip torch's lazy ~1-2 s import (--no-preload)
  forkserver preloads torch             --start-method forkserver --run-path: new processes from a
                                        clean server that imported torch once (restart ~0.6 s)
  exception logs preformatted           torch's log formatter imports torch._dynamo (~2 s) to log
                                        a worker failure: it delayed every restart
  hang watchdog on                      gloo has none: a worker without a heartbeat for
                                        --hang-timeout s (auto: max(floor, 10 x longest step))
                                        gets its Python stacks dumped and is killed; the agent
                                        restarts the group
  orphan check on                       a worker whose agent died exits instead of training on
                                        (any start method: workers check the agent's pid)
  SIGTERM/SIGINT to the agent           workers get it too; the agent logs agent_exit and exits
                                        128+signal (143), no traceback (torchrun: 1); from its
                                        start, and within 2 s when blocked in a store call
  ... or to the workers alone           workers that stopped on it: exit 128+signal, no restart
                                        (torchrun: 0, a finished job, or a restart)
  error a restart will not fix          a worker that exits 78 (state does not fit the checkpoint,
                                        no checkpoint loads, unusable run dir, bad argument): no
                                        restart, exit 78 (torchrun: restarts, then 1)
Single node without --rdzv-endpoint: c10d on a free localhost port (as torchrun --standalone).
For several agents use --rdzv-conf is_host=false with a store that outlives them.
"""


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus trainguard's options (``--fault``, ``--run-dir``, watchdog)."""
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "trainguard run"
    p.description = DEFAULTS_TEXT
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.set_defaults(max_restarts=3)
    g = p.add_argument_group("trainguard")
    g.add_argument("--run-dir", default=os.environ.get("TRAINGUARD_RUN_DIR", "trainguard-run"),
                   help="directory of the event log and fault markers; point your CheckpointManager "
                        "here (workers get it as TRAINGUARD_RUN_DIR). Default: ./trainguard-run")
    g.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="fault drill 'step=N,rank=R,kind=kill|exit|exception|hang|agent', fires once "
                        "per job (repeatable; plain torchrun: TRAINGUARD_FAULT='spec;spec')")
    g.add_argument("--hang-timeout", type=cli_args.seconds(0, strict=True), default=None, metavar="S",
                   help="seconds without a heartbeat before a worker is declared hung (default: "
                        "automatic, max(--hang-floor, 10 x the longest recent step))")
    g.add_argument("--hang-floor", type=cli_args.seconds(0, strict=True), default=60.0, metavar="S",
                   help="seconds: lower bound of the automatic hang timeout (default 60)")
    g.add_argument("--no-watchdog", action="store_true", help="disable the hang watchdog and orphan check")
    g.add_argument("--no-preload", action="store_true",
                   help="with --start-method fork, do not import torch._dynamo in the agent before forking "
                        "(torch imports it lazily in the first optimizer and in its log formatter: ~1-2 s "
                        "in every restarted worker otherwise)")
    g.add_argument("--stop-timeout", type=cli_args.seconds(0, strict=False), default=5.0, metavar="S",
                   help="seconds: on a restart, SIGKILL workers this long after SIGTERM (default 5; torch: fixed 30; "
                        "a membership restart waits --shutdown-timeout for their preemption save when longer)")
    p.error = cli_args.usage_error  # type: ignore[method-assign]
    return p


def prepare(args: argparse.Namespace) -> None:
    """Apply trainguard's defaults to ``args`` and to this process's environment (inherited by
    the workers). Called once, before the agent starts."""
    faults = [parse_fault(s) for s in args.fault]  # validate now, not at step 743
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    os.environ["TRAINGUARD_RUN_DIR"] = run_dir
    errfiles.default_log_dir(args)  # not a torchelastic_* directory in /tmp that nothing removes
    os.environ.setdefault("TRAINGUARD_JOB_ID", args.rdzv_id if args.rdzv_id != "none" else str(uuid.uuid4()))
    # The workers' orphan check (watchdog.agent_alive): this pid, not their parent's (the forkserver's).
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ[STOP_FILE_ENV] = stop_file(run_dir)  # workers that stop on a signal say so there (stops.py)
    if faults:
        os.environ["TRAINGUARD_FAULT"] = ";".join(f.spec() for f in faults)
    # How long a save waits for a dead peer (store default 10 s: survivors exited ~10 s late); heartbeats 0.5 s.
    os.environ.setdefault("TRAINGUARD_DEAD_AFTER", str(DEAD_AFTER))
    if not args.no_watchdog:
        os.environ["TRAINGUARD_WATCHDOG"] = "1"
        os.environ["TRAINGUARD_HANG_FLOOR"] = str(args.hang_floor)
        if args.hang_timeout is not None:
            os.environ["TRAINGUARD_HANG_TIMEOUT"] = str(args.hang_timeout)
    becomes_c10d = args.rdzv_backend == "c10d" or args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
        and str(args.nnodes).split(":")[-1] == "1"
    )
    if becomes_c10d:
        if args.rdzv_backend == "static" and not args.standalone:  # torch 2.13 does this too; 2.11 stayed on :29500
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = args.rdzv_id if args.rdzv_id != "none" else str(uuid.uuid4())
        given = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
        merged = {**RDZV_DEFAULTS, **given}
        args.rdzv_conf = ",".join(f"{k}={v}" for k, v in merged.items())


class _PreformatExceptions(logging.Filter):
    """Formats a record's traceback before torch's log formatter sees it. ``TorchLogsFormatter``
    imports ``torch._dynamo`` (1.7-2.6 s here) to format any record with ``exc_info``; the agent
    logs its worker failure that way, so every restart paid those seconds in "detect"."""

    _fmt = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        quiet_stop(record)  # a worker that saved on a stop signal and exited 143: no traceback
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self._fmt.formatException(record.exc_info)
            record.exc_info = None
        return True


def install_log_filter() -> None:
    """Attach :class:`_PreformatExceptions` to torch's log handlers and the elastic loggers (agent)."""
    f = _PreformatExceptions()
    targets: list[logging.Filterer] = [logging.getLogger(n) for n in (
        "torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.run")]
    for name in ("torch", ""):
        targets += logging.getLogger(name).handlers
    for t in targets:
        if not any(isinstance(x, _PreformatExceptions) for x in t.filters):
            t.addFilter(f)


def preload(args: argparse.Namespace) -> None:
    """Agent, once: with ``--start-method fork``, import ``torch._dynamo`` (torch imports it at the first optimizer:
    1.1-1.7 s per restarted worker here) and the library (``import trainguard`` binds it at its first use), which
    forked workers inherit; with ``forkserver``, the server (one per agent, outliving restarts) preloads them."""
    if args.no_preload:
        return
    if args.start_method == "fork":
        import torch._dynamo  # noqa: F401

        __import__("trainguard")._boot()  # a worker reached its manager's SIGTERM handler late without (test_newcode16a)
    elif args.start_method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "trainguard.manager"])


def main(argv: list[str]) -> int:
    """Run the agent for ``argv`` (torchrun flags, trainguard flags, script and its args); called
    by the ``trainguard run`` command, which exits with the result: 0 when the job succeeded, 1
    when it failed for good, 78 at once when a worker exited 78 (an error no restart fixes:
    :mod:`trainguard.permanent`), 128 + the signal's number when the agent was stopped by a signal
    (its workers were sent the same signal by torch's agent first)."""
    import torch.distributed.run as torch_run

    from ..permanent import run_script_path

    atexit.register(agentsig.ignore_late)  # first registered, last run: after_result's signals ignored at the end
    parser = build_parser()
    args = cli_args.parse(parser, argv)  # the script's own arguments are never read as abbreviated launcher options
    cli_args.check(args)  # what torchrun refuses only after the run directory and agent_start, and --rdzv-conf's items
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        # Otherwise every worker fails to open it, and the agent restarts them --max-restarts times.
        print(f"error: {args.training_script}: no such file; give the path of the training script (-m NAME for a module)", file=sys.stderr)
        return 2
    try:
        prepare(args)
    except OSError as e:  # the run directory: a file of that name, no permission, a read-only disk
        parser.error(f"--run-dir {args.run_dir}: " + (  # "cannot create the directory" of one there, or of a file
            "cannot create the directory (a file has that name); name a directory, or a new one" if os.path.isfile(args.run_dir) else
            f"cannot write in the directory ({e.strerror or e}); give this user write access to it, or name another"
            if os.path.isdir(args.run_dir) else f"cannot create the directory ({e.strerror or e})"))
    events = EventLog(os.path.join(os.environ["TRAINGUARD_RUN_DIR"], EVENTS_FILE), rank=-1, mono=True)  # clockback.py
    install_agent_hooks(events, args.stop_timeout)
    torch_run.run_script_path = run_script_path  # --run-path workers: exit 78 on a permanent error
    install_log_filter()
    events.emit("agent_start", argv=argv, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                rdzv_conf=args.rdzv_conf, faults=args.fault, job_id=os.environ["TRAINGUARD_JOB_ID"])
    names = agentsig.handled_names(args)
    late = agentsig.named(names)  # before torch's handler is on them: SIGUSR1 too when given, not an ignored one
    handled = install_early(names)
    sigwatch.start(handled, lambda n: sigwatch.exit_stuck(events, n, AGENT[0] if AGENT else None))
    code = _run_agent(args, events)
    agentsig.after_result(code, late)  # a stop signal from now on: reported, the exit code kept
    return code


def _run_agent(args: argparse.Namespace, events: EventLog) -> int:
    """:func:`main`, main thread: run torch's agent; its exit code, once ``agent_exit`` is logged."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    try:
        preload(args)
        run(args)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        for s in agentsig.torch_handled():  # it raises again on a second signal (a SIGUSR1 given too):
            signal.signal(s, signal.SIG_IGN)  # no traceback while logging (main's after_result then)
        events.emit("agent_exit", ok=False, signal=sig.name, error=str(e)[-2000:])
        sent = f"the workers were sent {sig.name}" if len(AGENT) > 1 else "in the rendezvous, before any worker started"
        print(f"trainguard run: stopped by {sig.name}; {sent}; see {events.path}", file=sys.stderr)
        keepalive.stop()  # torch leaves it running on a signal: a heartbeat ending at exit aborted the agent
        clear(os.environ.get(STOP_FILE_ENV))  # the workers' stop notes: one stopped-<host>-<pid> was left per preemption
        return 128 + int(sig)
    except ChildFailedError as e:
        if (code := agent_result(events, e.failures)) is not None:
            return code
        events.emit("agent_exit", ok=False, error=str(e)[-2000:])
        n = RESTARTS.count("failure")  # "after its restarts" with --max-restarts 0 said restarts had been tried
        print(f"trainguard run: the job failed after {n} restart{'' if n == 1 else 's'} (--max-restarts {args.max_restarts}); "
              f"see {events.path}", file=sys.stderr)
        return 1
    except RendezvousError as e:  # the store gone (storelost.py's grace over, a restart into it), closed, a timeout
        why = f"{type(e).__name__}: {e}" + (f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else "")
        events.emit("agent_exit", ok=False, error=why[-2000:])  # before: a traceback, no agent_exit
        print(f"trainguard run: the rendezvous failed; this node stopped (exit 1): {why}; see {events.path}",
              file=sys.stderr)
        return 1
    if (code := agent_result(events, {})) is not None:
        return code
    events.emit("agent_exit", ok=True)
    return 0
