"""Errors a restart will not fix, and the exit code that says so (docs/elastic.md, "Exit codes
for a requeue wrapper").

A worker that fails with such an error (the script's state no longer fits the checkpoint, every
checkpoint has bad bytes, the run directory is a file or not writable, another live job on this
host holds its lock, a bad argument to trainguard) would fail the same way at every restart (the
run lock lost while the job ran, ``runlock.lock_lost``: a restart would hide an ``rm -rf``):
``trainguard run`` restarted it ``--max-restarts`` times and exited 1, and a requeue wrapper
requeued it. trainguard marks those errors (:func:`mark`; ``permanent = True`` on the class of
``StateMismatchError``, ``UnsupportedValueError``, ``FormatVersionError``) and such a process
exits with :data:`PERMANENT_EXIT` (78):

* under ``trainguard run``: the workers' ``sys.excepthook`` (:func:`install_excepthook`, from
  ``import trainguard`` when the agent's ``TRAINGUARD_AGENT_PID`` names another process) and,
  with ``--run-path``, :func:`run_script_path`; the agent (:mod:`.elastic.stops`) restarts no
  worker that exited 78 and exits 78 itself;
* under plain ``python``: ``sys.exit(tg.exit_code_for(e))`` (:func:`exit_code_for`).

Not permanent (conservative): store timeouts, a rank dying, a medium's I/O error (EIO, an object
store's), a full disk, a lock whose holder is on another host (a lost node's NFS lock lingers).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shlex
import sys
import traceback
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from . import layout
from .errors import (
    CheckpointError,
    is_media_error,
    is_store_client_error,
    nonneg_int,
    store_refused,
    store_unusable,
)

PERMANENT_EXIT = 78  # sysexits.h EX_CONFIG: not 1 (any crash), 75/76 (hang, orphan), 128 + n (signals)
E = TypeVar("E", bound=BaseException)


def mark(e: E) -> E:
    """Any raiser in trainguard: ``e`` is an error no restart fixes. Returns ``e``."""
    if isinstance(e, CheckpointError):
        e.permanent = True
    else:
        e._trainguard_permanent = True  # type: ignore[attr-defined]
    return e


def is_permanent(e: BaseException | None) -> bool:
    """Whether ``e``, or an error it was raised ``from`` (``__cause__``), is marked permanent. Not
    the error it was raised while handling (``__context__``): a script that caught a permanent error
    and retried in its ``except`` block is in no permanent failure if that retry loses the store."""
    seen = 0
    while e is not None and seen < 20:
        if getattr(e, "_trainguard_permanent", False) or (isinstance(e, CheckpointError) and e.permanent):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def exit_code_for(e: BaseException | None) -> int:
    """The exit code for a process ending with ``e``: 78 when no restart will fix it, else 1
    (0 for no error). Plain ``python``: ``except Exception as e: ...; sys.exit(tg.exit_code_for(e))``."""
    if e is None:
        return 0
    if not isinstance(e, BaseException):  # exit_code_for(str(e)): is_permanent's AttributeError before
        raise TypeError(f"exit_code_for({e!r:.80}): pass the exception itself (or None), e.g. `except Exception as e: "
                        "sys.exit(tg.exit_code_for(e))`")
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return PERMANENT_EXIT if is_permanent(e) else 1


def from_medium(e: BaseException | None) -> bool:
    """Whether ``e`` came from a medium's or an object store's I/O error (its chain holds one, or
    another rank said so: ``medium``): ``restore`` does not call its failure permanent."""
    seen = 0
    while e is not None and seen < 20:
        if getattr(e, "medium", False) or is_media_error(e) or (isinstance(e, OSError) and getattr(e, "remote", False)):
            return True
        e, seen = e.__cause__, seen + 1
    return False


@contextlib.contextmanager
def keeps_own(e: BaseException | None) -> Iterator[None]:
    """Around a round that tells the other ranks this rank's error ``e`` (``errors.agree_load``,
    ``api._collective_capture``): when that exchange fails (rank 0 read ``e``, exited 78 and took
    the c10d store its process hosts along), an ``e`` no restart fixes is raised instead of the
    lost store's error, so that this rank exits 78 too (else 1: its node's agent restarted into a
    closed rendezvous). Any other ``e``: the exchange's failure goes through."""
    try:
        yield
    except CheckpointError:
        if e is not None and is_permanent(e):
            raise e from e.__cause__
        raise


def mark_refusal(cause: BaseException, err: E) -> E:
    """``loader.load``: ``err``, an entry's ``load_state_dict`` refusing the saved state with
    ``cause``, marked unless ``cause`` is a RuntimeError (an out-of-memory, a device's error)."""
    return err if isinstance(cause, RuntimeError) else mark(err)


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Around trainguard's argument checks: a ValueError/TypeError raised inside is marked."""
    try:
        yield
    except (ValueError, TypeError) as e:
        mark(e)
        raise


def headline(message: str) -> str:
    """An error's message in one line: its first line and, for a longer one (a rank's traceback
    in a ``RankFailureError``, the list of a failed restore), its last, which says what to change."""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    if not lines:
        return ""
    return lines[0][:500] + (f" ... {lines[-1][:500]}" if len(lines) > 1 else "")


def say(e: BaseException, who: str = "trainguard") -> None:
    """One line on stderr naming the error and the exit code (its message says what to change)."""
    try:
        text = str(e)
    except Exception:  # its __str__ raised: the excepthook failed, and the process exited 1, not 78
        text = "<exception str() failed>"
    print(f"{who}: {type(e).__name__}: {headline(text)}\n{who}: a restart will not fix this error; "
          f"exit {PERMANENT_EXIT} (not restarted by trainguard run)", file=sys.stderr, flush=True)


def _finish(code: int) -> None:
    """The end of a process whose exception was reported: atexit handlers, the buffers of files
    still open (a metrics file the script never closed: Python's own exit flushes them), then
    ``code``. ``os._exit``: Python's exit status after an uncaught exception is always 1."""
    import gc
    import io
    import warnings

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    # isinstance() on every object warns for deprecated ones (torch.distributed.reduce_op: a FutureWarning
    # line at every such exit), and under `python -W error` that warning raised: exit 1, not code.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            with contextlib.suppress(BaseException):
                if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                    obj.flush()
    os._exit(code)


ERROR_FILE_OWNER_ENV = "TRAINGUARD_ERROR_FILE_OWNER"  # "<pid>:<path>": the worker whose error file it is


def claim_error_file() -> None:
    """A worker of ``trainguard run`` (:func:`install_excepthook`, :func:`run_script_path`): note in its
    environment that ``TORCHELASTIC_ERROR_FILE`` is this process's, so a process it starts (inheriting the
    variable: ``subprocess.run([sys.executable, "eval.py"])``, a spawned child importing trainguard) does not
    write it. A file of another agent (a ``trainguard run`` nested in the worker) is claimed again."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and os.environ.get(ERROR_FILE_OWNER_ENV, "").partition(":")[2] != path:
        os.environ[ERROR_FILE_OWNER_ENV] = f"{os.getpid()}:{path}"


def _owns_error_file(path: str) -> bool:
    pid, _, owned = os.environ.get(ERROR_FILE_OWNER_ENV, "").partition(":")
    return owned != path or pid == str(os.getpid())


def _record(e: BaseException) -> None:
    """torch's error file (``TORCHELASTIC_ERROR_FILE``, in torch's format) unless the worker wrote one (torch's
    ``@record``) or this process is not the worker the agent gave it to (:func:`claim_error_file`; before, a
    helper subprocess's error was the rank's failure in the ``failure`` event, and the rank's own was lost): the
    agent's failure then has the message and traceback (its report, the ``failure`` event). Never raises (an
    exception whose ``str()`` raised made the excepthook fail, and a permanent error exited 1, not 78).
    Not torch's ``ErrorHandler.record_exception``: in an excepthook its traceback was "NoneType: None"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and isinstance(e, Exception) and _owns_error_file(path)) or os.path.exists(path):
        return
    import json
    import time

    with contextlib.suppress(Exception):
        trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            message = f"{type(e).__name__}: {e}"
        except Exception:
            message = trace.rstrip().rpartition("\n")[2]  # traceback's own last line: "X: <exception str() failed>"
        data = {"message": {"message": message, "extraInfo": {"py_callstack": trace, "timestamp": str(int(time.time()))}}}
        with open(path, "w") as f:
            json.dump(data, f)


def _hook(kind: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
    previous = getattr(_hook, "previous", sys.__excepthook__)
    if not is_permanent(e):
        from .elastic.stops import note_raised

        note_raised()  # first: the agent names the rank that raised first (stops.first_failure)
    previous(kind, e, tb)
    _record(e)  # the agent's failure event and report carry the traceback (any error; a script worker wrote none)
    if is_permanent(e):
        say(e)
        _finish(PERMANENT_EXIT)


def install_excepthook() -> None:
    """``import trainguard`` in a worker of ``trainguard run`` (its ``TRAINGUARD_AGENT_PID`` is
    another process): an uncaught permanent error ends the process with 78 instead of Python's 1,
    after the usual traceback and ``atexit`` handlers (non-daemon threads are not waited for)."""
    agent = os.environ.get("TRAINGUARD_AGENT_PID", "")
    if not agent.isdigit() or int(agent) == os.getpid() or sys.excepthook is _hook:
        return
    claim_error_file()  # its TORCHELASTIC_ERROR_FILE: not written by the processes it starts
    _hook.previous = sys.excepthook  # type: ignore[attr-defined]
    sys.excepthook = _hook


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """``trainguard run --run-path``'s worker entry point (torch's ``run_script_path``, which the
    agent replaces with it): torch's worker wrapper turns any exception into exit 1, so a
    permanent one is reported here and becomes ``SystemExit(78)``."""
    import runpy

    from .elastic.reap import own_session, threads_from_env

    own_session()  # its DataLoader processes end with it (the agent's end_trees)
    claim_error_file()  # a forked worker did not run install_excepthook
    threads_from_env()  # a forked worker kept the agent's torch thread count, not OMP_NUM_THREADS's
    sys.argv = [training_script, *training_script_args]  # as torch's run_script_path
    try:
        runpy.run_path(training_script, run_name="__main__")
    except Exception as e:
        if not is_permanent(e):
            from .elastic.stops import note_raised

            note_raised()  # when: the agent names the rank that raised first (stops.root_failure)
            raise
        traceback.print_exc()
        _record(e)
        say(e)
        raise SystemExit(PERMANENT_EXIT) from e


def is_flag(v: Any) -> bool:
    """True or False, 0 or 1, a numpy bool or integer scalar, or a one-value bool or integer tensor
    (``overwrite=val_loss < best``: ``tensor(True)``). Not a float (``1.0``, ``tensor(1.0)``,
    ``np.float64(1.0)``: refused alike) nor a string."""
    from torch import is_tensor

    if is_tensor(v):
        ok = v.numel() == 1 and not (v.is_floating_point() or v.is_complex() or v.is_meta)  # meta: no value to read
    elif type(v).__module__ == "numpy":
        ok = getattr(v, "shape", None) == () and getattr(getattr(v, "dtype", None), "kind", "") in ("b", "i", "u")
    else:
        ok = type(v) in (bool, int)
    return ok and bool(v in (True, False))


def check_flags(**flags: Any) -> None:
    """The on/off arguments of ``tg.save`` and ``CheckpointManager``, before any I/O: what
    :func:`is_flag` takes, as ``tg.load``'s ``strict``. A string is truthy: ``overwrite="no"``
    (a value read from a config file or an environment variable) replaced an existing checkpoint,
    ``async_="no"`` made the save asynchronous, ``split_state="no"`` split it."""
    if bad := [f"{k}={v!r}" for k, v in flags.items() if not is_flag(v)]:
        raise TypeError(f"{', '.join(bad)}: pass True or False")


def flag(name: str, value: Any) -> bool:
    """``CheckpointManager.save``'s ``force`` and ``close``'s ``keep_ram_tier``: the value when it is True
    or False (:func:`check_flags`), else a ``TypeError`` (permanent) before anything is done:
    ``keep_ram_tier="no"`` kept the RAM copies in ``/dev/shm``, ``force="no"`` saved."""
    with config_errors():
        check_flags(**{name: value})
    return bool(value)


def check_save_args(async_: Any, overwrite: Any, stage_in_background: Any, split_state: Any,
                    max_staging_bytes: Any, metadata: Any) -> None:
    """``tg.save``: its arguments, before any I/O (``max_staging_bytes`` whether or not the save is
    async, as ``CheckpointManager`` checks it: ``"1G"`` was taken without a word by a sync save)."""
    check_flags(async_=async_, overwrite=overwrite, stage_in_background=stage_in_background, split_state=split_state)
    if stage_in_background and not async_:
        raise ValueError("stage_in_background=True needs async_=True (a sync save copies nothing: it writes from the tensors)")
    if max_staging_bytes is not None:
        nonneg_int(max_staging_bytes, f"max_staging_bytes={max_staging_bytes!r}: pass a byte count (an int >= 0), or None for no cap")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata={metadata!r}: pass a dict of JSON values, e.g. metadata={{'lr': 3e-4}}")


def check_manager_args(save: Any, keep: Any, layout: str, on_error: str, timeout: float | None,
                       max_staging_bytes: int | None, async_save: bool, stage_in_background: bool,
                       split_state: bool = False, root: Any = None, handle_signals: Any = True,
                       ram_tier: Any = False) -> None:
    """``CheckpointManager.__init__`` (inside :func:`config_errors`): its arguments, before any I/O."""
    if isinstance(root, str) and not root:  # an unset variable: the manager wrote into the current directory
        raise ValueError("CheckpointManager(root=''): pass the run directory (a path or URL) to save into")
    check_flags(async_save=async_save, stage_in_background=stage_in_background, split_state=split_state,
                handle_signals=handle_signals)
    bool_like = is_flag(ram_tier) and str(getattr(ram_tier, "dtype", "bool")) in ("bool", "torch.bool") \
        and type(ram_tier) is not int  # True, np.True_, tensor(True); not 1 (a size? a count?)
    if ram_tier is not None and not bool_like and not isinstance(ram_tier, (str, os.PathLike)):
        # 1 failed in os.fspath ("expected str, bytes or os.PathLike object, not int"); None and '' (an unset
        # variable) are off, as before
        raise TypeError(f"ram_tier={ram_tier!r}: pass True (/dev/shm), a directory on a tmpfs, or False")
    from .dist import check_timeout
    from .policies import RetentionPolicy, SavePolicy
    from .split import refuse_full

    if stage_in_background and not async_save:
        raise ValueError("stage_in_background=True needs async_save=True")
    if max_staging_bytes is not None:  # an int >= 0 (a str, a float, True: a TypeError saying so)
        nonneg_int(max_staging_bytes, f"max_staging_bytes={max_staging_bytes!r}: pass a byte count (an int >= 0), or None for no cap")
    if layout not in ("sharded", "full"):
        raise ValueError(f"layout={layout!r}: use 'sharded' (each rank writes its part) or 'full'")
    refuse_full(split_state, layout)
    check_timeout(timeout)
    if on_error not in ("raise", "warn"):
        raise ValueError(f"on_error={on_error!r}: use 'raise' or 'warn'")
    if save is not None and not isinstance(save, SavePolicy):
        raise TypeError(f"save={save!r}: pass a save policy such as tg.EveryNSteps(100)")
    if keep is not None and not isinstance(keep, RetentionPolicy):
        raise TypeError(f"keep={keep!r}: pass a retention policy such as tg.KeepLatest(3)")


def open_error(e: Exception, root: str) -> CheckpointError:
    """``CheckpointManager.open`` on rank 0: its error ``e`` as the ``CheckpointError`` every rank
    raises. A file where the directory should be, or no permission: permanent (a lock held by
    another live job is already marked by ``RunLock``); any other OSError (EIO, ENOSPC, ESTALE) not.
    An object store's client error (an unreachable endpoint: botocore's EndpointConnectionError,
    not an OSError) too, not permanent; any other exception is raised as it is."""
    if isinstance(e, CheckpointError):
        return e
    if not isinstance(e, OSError):
        if not is_store_client_error(e):
            raise e
        err = CheckpointError(f"cannot open {root}: {store_unusable(e)}")
        err.__cause__ = e
        return err
    path_given = isinstance(e, (FileExistsError, NotADirectoryError))
    step = _step_of_manifest(getattr(e, "filename", None))
    if step is not None:  # clean_debris cannot tell a committed checkpoint from a crashed save's debris
        err = CheckpointError(
            f"cannot open {root}: whether {step} holds its manifest cannot be checked ({e}); the open removes step "
            "directories without one (crashed saves), so it stops: fix the storage or its permissions, or move "
            f"{step} out of {root} to start from the other checkpoints (`trainguard verify {root}` checks them)")
    elif isinstance(e, PermissionError) and "://" in root and not root.lower().startswith("file:"):
        err = CheckpointError(f"cannot open {root}: {store_refused(e)}")  # a wrong secret key, a bucket policy
    elif isinstance(e, PermissionError) or e.errno == errno.EROFS:
        # A read-only copy (chmod -R a-w, a read-only mount): the manager writes its lock, removes crashed
        # saves and saves; reading needs none of that, so say how to read it without a manager.
        err = CheckpointError(
            f"cannot open {root} ({e}): a CheckpointManager writes there (its .lock, the removal of crashed "
            "saves, new checkpoints); make it writable, or copy it to a writable directory, or to only read "
            f"this copy load one step without a manager: trainguard.load('{root}/step-N', state) (`trainguard "
            f"ls {shlex.quote(root)}` lists the valid steps)")
    else:
        err = CheckpointError(f"cannot open {root} ({e}): " + (
            "pass a directory path" if path_given else "fix the storage or its permissions, then start again"))
    err.__cause__ = e
    return mark(err) if path_given or isinstance(e, PermissionError) or e.errno == errno.EROFS else err


def _step_of_manifest(filename: Any) -> str | None:
    """``open_error``: the step directory whose ``manifest.json`` an OSError names (its stat failed
    in ``commit.list_steps``), or None."""
    if not isinstance(filename, str):
        return None
    parent, name = os.path.split(filename)
    return parent if name == layout.MANIFEST and layout.parse_step(os.path.basename(parent)) is not None else None
