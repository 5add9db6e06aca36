"""The agent's files of its workers' errors, kept out of the temp directory (``trainguard run``).

Two kinds of file, both in the temp directory (``TMPDIR``, ``/tmp``) under torchrun, and neither
removed by torch:

* ``pytorch-errorfile-*.pickle``: ``torch.multiprocessing.start_processes`` (function workers:
  ``--run-path``, any start method) names one per worker; a worker that raises pickles its traceback
  into it, and the agent's ``ProcessContext.join`` reads the failed worker's (the traceback of
  ``ProcessRaisedException``, which the agent logs). Every raising worker left its file (~2 KB): a
  worker killed by a fault and its peer failing in the broken collective left one per restart, two
  when both raised. :func:`install` removes a context's files when the agent closes it (each restart
  and the agent's exit), after torch read the one it reads.
* ``torchelastic_*/``: without ``--log-dir`` torch's agent makes its log directory there (each worker's
  ``error.json``, the traceback that ``ChildFailedError`` and ``agent_exit`` report, and the logs of
  ``--redirects``/``--tee``). :func:`default_log_dir` makes it a private ``trainguard-logs-*`` directory
  in the temp directory instead, removed when the agent exits; with ``--redirects``/``--tee`` (the
  workers' output is in it) torch's own, kept as before. Not in the run directory (session 52 tried
  ``<run dir>/.trainguard/logs``): a run directory removed while the job ran took the workers'
  ``error.json`` with it, and the agent no longer said why they failed ("the run directory's .lock was
  removed"); and on a full checkpoint disk redirected output made the workers fail.

The file also holds the traceback of a worker that :func:`.stops.root_failure` names instead of the one
torch's ``join`` found first (several raised: the first to raise is the cause): :func:`failure` reads it, as
``join`` would have. Before, the agent logged the other worker's traceback (rank 0's gloo "Connection closed
by peer") and then "process 1 terminated with exit code 1": the cause's own error was in no line of its output.

Called by :func:`.launcher.prepare` (:func:`default_log_dir`, once, before the agent starts),
:func:`.launcher.install_agent_hooks` (:func:`install`, once, in the agent's process) and
:func:`.stops.root_failure` (:func:`failure`, in the agent's ``ProcessContext.join`` hook).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import pickle
import shutil
import tempfile
from typing import Any

LOG_PREFIX = "trainguard-logs-"


def default_log_dir(args: argparse.Namespace) -> str | None:
    """``--log-dir`` not given (or empty) and no ``--redirects``/``--tee``: a new ``trainguard-logs-*`` directory
    in the temp directory, removed when this process (the agent) exits, not a ``torchelastic_*`` one that
    nothing removes; its path (None: ``--log-dir`` given, or the workers' output goes to torch's own, kept)."""
    if args.log_dir or str(getattr(args, "redirects", "0")) != "0" or str(getattr(args, "tee", "0")) != "0":
        return None
    args.log_dir = path = tempfile.mkdtemp(prefix=LOG_PREFIX)
    _MADE[:] = [(os.getpid(), path)]
    atexit.register(remove_log_dir)
    return path


_MADE: list[tuple[int, str]] = []  # (the agent's pid, the log directory default_log_dir made)


def remove_log_dir() -> None:
    """Agent, at its exit (atexit), or ``launcher``'s exit from the signal watcher (``os._exit`` skips atexit):
    remove the directory :func:`default_log_dir` made. Only the agent does: a worker forked from it
    (``--start-method fork``) inherits atexit handlers."""
    for pid, path in _MADE:
        if os.getpid() == pid:
            shutil.rmtree(path, ignore_errors=True)


def drop(pc: Any) -> None:
    """Remove the error files torch's ``ProcessContext`` ``pc`` named for its workers (those a worker
    wrote; the others were never made). Only once its processes are stopped: a running worker may still
    write its own."""
    for path in getattr(pc, "error_files", None) or ():
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


def install(context_cls: Any) -> None:
    """Wrap ``context_cls.close`` (torch's ``MultiprocessContext``) to :func:`drop` its process context's
    error files after torch (and trainguard's ``_close`` hooks) stopped and joined its workers. torch's
    ``_poll`` reads the failed worker's file before it closes the context; a worker the bounded close
    abandoned (alive after SIGKILL: a process in uninterruptible sleep) keeps its file if it writes later."""
    if getattr(context_cls, "_tg_errfiles", False):
        return
    orig_close = context_cls.close

    def close(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            orig_close(self, *args, **kwargs)
        finally:
            drop(getattr(self, "_pc", None))

    context_cls.close = close
    context_cls._tg_errfiles = True


class _TextOnly(pickle.Unpickler):
    """Reads a pickled ``str`` (what torch's ``spawn._wrap`` writes: ``traceback.format_exc()``), and no object."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"not a traceback: {module}.{name}")


def failure(pc: Any, i: int) -> Exception:
    """The exception torch's ``ProcessContext.join`` raises for its process ``i`` of ``pc`` (once stopped):
    ``ProcessRaisedException`` with the traceback the worker wrote to its error file, else (it wrote none:
    killed, ``os._exit``, ``sys.exit``) ``ProcessExitedException`` with its exit code."""
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    proc, files = pc.processes[i], list(getattr(pc, "error_files", None) or ())
    trace = None
    if proc.exitcode == 1 and i < len(files) and files[i]:  # spawn._wrap writes it, then exits 1
        with contextlib.suppress(OSError, EOFError, ValueError, pickle.UnpicklingError), open(files[i], "rb") as f:
            trace = _TextOnly(io.BytesIO(f.read(1 << 24))).load()
    if isinstance(trace, str):
        return ProcessRaisedException(f"\n\n-- Process {i:d} terminated with the following error:\n{trace}", i, proc.pid)
    return ProcessExitedException(f"process {i} terminated with exit code {proc.exitcode}",
                                  error_index=i, error_pid=proc.pid, exit_code=proc.exitcode)
