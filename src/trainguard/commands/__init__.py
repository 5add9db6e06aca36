"""One module per group of ``trainguard`` subcommands; :mod:`trainguard.cli` registers them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import click
from rich.console import Console


def printable(s: Any) -> str:
    """A string from a checkpoint (a tensor name, a path) safe to print: control characters
    written as ``\\xNN``, so that an escape sequence in a name never reaches the terminal, and
    bidirectional overrides as ``\\uNNNN`` (they reorder what a terminal shows), a path's
    byte that is not UTF-8 as ``\\xNN``, and any other lone surrogate (a state key ``"w\\ud800"``,
    which the manifest's JSON holds as written) as ``\\uNNNN``: UTF-8 has no encoding for one, so
    printing it raised UnicodeEncodeError (``inspect``'s traceback instead of its tree)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]", _escaped, str(s))


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:  # a byte of a path that is not UTF-8 (os.fsdecode's surrogateescape): stdout
        return f"\\x{c - 0xDC00:02x}"  # with errors="strict" (a UTF-8 locale) raised UnicodeEncodeError
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def counted(n: int, noun: str) -> str:
    """``"1 tensor"``, ``"2 tensors"``: the commands' closing lines (``export``, ``convert``, ``consolidate``)
    said "converted 1 tensors" and "saved by 1 ranks"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def stdout_gone() -> None:
    """The reader of stdout went away (``trainguard verify RUN | head -1``): send the rest of the
    output to /dev/null, so that the command finishes its work and exits with its own code (verify's
    verdict; 0 for a listing), not click's or rich's 1 for a broken pipe, which a ``set -o pipefail``
    script takes for a failed verification. Called by :func:`echo`, the commands' rich console and
    ``cli._Group.invoke``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def echo(message: str = "") -> None:
    """``click.echo`` to stdout for output written while a command still works (``consolidate``'s
    progress, ``demo``'s log): a closed pipe silences the rest instead of ending the work."""
    try:
        click.echo(message)
    except BrokenPipeError:
        stdout_gone()


class CommandError(click.ClickException):
    """A command's own refusal, shown as every error of this CLI is: one ``error:`` line on stderr
    and exit code 2 (an input the command cannot use: a run directory without events, a demo's
    out-of-range steps), or ``exit_code`` (1: the command ran and what it checked failed).
    click's ClickException printed ``Error:`` and exited 1, the code ``verify`` gives a corrupt run.
    Raised by the commands; click's ``main`` shows it and exits. ``detail``: lines shown under it,
    each made printable on its own (a failed run's log tail; in the message its newlines were
    written as ``\x0a``, the whole tail on one line)."""

    def __init__(self, message: str, exit_code: int = 2, detail: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.detail = detail
        self.as_json = False  # set by cli._Group.invoke when the command was given --json
        self.kind = "command"  # "usage": click's error of an option or argument (cli._usage)

    def show(self, file: Any = None) -> None:
        """click's ``main`` calls it before exiting with ``exit_code``: one ``error:`` line on stderr, or with
        ``--json`` one JSON object on stdout (:func:`failed`)."""
        if self.as_json:
            out = {"error": printable(self.format_message()), "kind": self.kind, "exit_code": self.exit_code}
            click.echo(json.dumps(out | ({"detail": self.detail.splitlines()} if self.detail else {})), file=file)
            return
        click.echo(f"error: {printable(self.format_message())}", err=True, file=file)
        for line in self.detail.splitlines():
            click.echo(f"  {printable(line)}", err=True, file=file)


def failed(message: str, code: int, kind: str, as_json: bool, prefix: str = "error") -> None:
    """``cli._Group.invoke``'s end of a command that failed: ``<prefix>: message`` on stderr, or with ``--json``
    ``{"error": message, "kind": kind, "exit_code": code}`` on stdout (a script parses it: before polish58 a
    command given --json printed its error as text on stderr and nothing on stdout); then exit ``code``.
    ``kind``: the error's class name (``NotACheckpointError``, ``CorruptCheckpointError``, ``OSError``...),
    ``"usage"``, ``"command"``, ``"store"`` or ``"interrupted"``."""
    if as_json:
        click.echo(json.dumps({"error": message, "kind": kind, "exit_code": code}))
    else:
        click.echo(f"{prefix}: {message}", err=True)
    sys.exit(code)


def wants_json(group: click.Group, ctx: click.Context) -> bool:
    """``cli._Group.invoke``, before the command runs: whether the command named on the command line has a
    ``--json`` option and it was given (before a ``--``). Read from the arguments, not the parsed options: an
    error parsing another option comes before ``--json`` is parsed."""
    args = [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or ()), *ctx.args]
    cmd = group.get_command(ctx, args[0]) if args else None
    if cmd is None or not any(p.name == "as_json" for p in cmd.params):
        return False
    rest = args[1:]
    return "--json" in (rest[:rest.index("--")] if "--" in rest else rest)


def check_plot_target(plot: str) -> None:
    """Before a command prints or trains (``report``, ``plan``, ``demo``): ``--plot``'s file can be
    written, or :class:`CommandError` saying what to change. A directory this user may not write to
    was told, after the summary, as "Permission denied (run the command as the user that wrote the
    checkpoints, or give this one read access)" (``cli._os_error``'s words for reading a checkpoint);
    one that does not exist as "No such file or directory"."""
    head = os.path.dirname(plot) or "."
    if not os.path.isdir(head):
        raise CommandError(f"--plot {printable(plot)}: the directory {printable(head)} does not exist; create it first")
    if not os.access(head, os.W_OK | os.X_OK) or (os.path.exists(plot) and not os.access(plot, os.W_OK)):
        raise CommandError(f"--plot {printable(plot)}: this user may not write {'it' if os.path.exists(plot) else 'in ' + printable(head)}; "
                           "name a file in a directory you may write to")


def ram_tier_given(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """click's callback of ``ls``'s and ``verify``'s ``--ram-tier``, as click parses them: a directory named on the
    command line must exist (the default, /dev/shm, may be absent: not Linux). Before (review55e), a mistyped one
    listed no RAM copies without a word, as if this node held none."""
    from click.core import ParameterSource

    if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE and not os.path.isdir(value):
        raise click.BadParameter(f"{printable(value)}: no such directory; name the directory the manager's "
                                 "ram_tier= keeps its copies in on this node (ram_tier=True: /dev/shm)")
    return value


@contextlib.contextmanager
def plot_written(plot: str) -> Iterator[None]:
    """Around the write of ``--plot``'s file (``report``, ``plan``): :func:`check_plot_target` first,
    then an OSError of the write (the disk full, a permission changed since) is one ``error:`` line
    naming the option, exit 2."""
    check_plot_target(plot)
    try:
        yield
    except OSError as e:
        raise CommandError(f"--plot {printable(plot)}: cannot write it ({e.strerror or e}); name a file in a "
                           "directory you may write to") from e


class PipeConsole(Console):
    """rich's console for the commands' output, except that a closed pipe (``| head``) silences
    the rest instead of exiting 1 (rich's ``on_broken_pipe``): ``verify`` goes on to its verdict.
    Lines are not wrapped (``soft_wrap``): piped output is 80 columns wide to rich, which broke a
    long path in two (``wrote 2 tensors to /long/.../w.p`` and ``t``); tables still fit the width."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("soft_wrap", True)
        super().__init__(**kw)

    def on_broken_pipe(self) -> None:
        """rich calls it when a write to stdout fails with EPIPE."""
        self.quiet = True
        stdout_gone()


class Terminated(KeyboardInterrupt):
    """SIGTERM while a command writes (``timeout``, a scheduler's stop, ``kill PID``): unwound as a
    Ctrl-C is, so the library's cleanup (``except BaseException``) removes the temporary file or
    directory; Python's default for SIGTERM ended the process at once and left it behind."""


NOT_INSTALLED = object()  # raise_terminated_on_sigterm: no handler set, none to put back


def raise_terminated_on_sigterm(then: Any = signal.SIG_DFL) -> Any:
    """On the main thread: the first SIGTERM raises :class:`Terminated` and leaves SIGTERM at ``then``
    (``SIG_DFL``: a second one ends the process at once; ``SIG_IGN``: the next are ignored). Returns the
    handler to put back with :func:`restore_sigterm`; ``NOT_INSTALLED`` off the main thread, or where the
    process inherited SIGTERM ignored, which stays so (`trap '' TERM`, a launcher's own shutdown, as
    Python leaves an ignored SIGINT ignored: it ended the command, exit 143). ``terminated_as_interrupt``
    and ``demo`` call it."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return NOT_INSTALLED

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, then)
        raise Terminated

    return signal.signal(signal.SIGTERM, on_term)


def restore_sigterm(old: Any) -> None:
    """Put back the handler :func:`raise_terminated_on_sigterm` replaced (``None``: one not set from Python)."""
    if old is not NOT_INSTALLED:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


@contextlib.contextmanager
def terminated_as_interrupt(what: str) -> Iterator[None]:
    """Around a command that writes ``what`` (``consolidate``, ``convert``, ``export``), on the main
    thread: the first SIGTERM raises :class:`Terminated` (a second one ends the process at once),
    and the command exits 143 with one line on stderr once the partial output is removed (or saying
    ``what`` was written whole, when the signal came after its rename into place); a Ctrl-C
    (SIGINT) likewise, exit 130. A SIGTERM the process inherited ignored stays ignored."""
    before = _identity(what)
    old = raise_terminated_on_sigterm()
    try:
        yield
    except KeyboardInterrupt as e:  # Terminated (SIGTERM) or Ctrl-C
        # A signal after the rename into place (the parent's fsync, the return): the output is whole.
        # It said "was not written" of a complete DST (a rerun without --overwrite was then refused);
        # Ctrl-C there ended in click's "Aborted!", exit 1, and no word that DST was complete.
        term = isinstance(e, Terminated)
        done = (now := _identity(what)) is not None and now != before
        click.echo(f"{'terminated' if term else 'interrupted'}: {printable(what)} "
                   + ("was written whole before the signal (it is complete)" if done
                      else "was not written (its partial output is removed)"), err=True)
        sys.exit(143 if term else 130)
    finally:
        restore_sigterm(old)


def _identity(what: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the local file or directory ``what`` (a path or ``file:`` URL), ``None``
    when there is none (or ``what`` is an object store's URL): :func:`terminated_as_interrupt` tells
    an output renamed into place (a new inode) from an earlier one left as it was."""
    from ..export import local_file  # a file: URL as the path it names, as the commands read it

    try:
        p = local_file(what)
        if "://" in p:
            return None
        st = os.stat(p)
    except Exception:  # OSError; a file: URL of another host (CheckpointError): not known
        return None
    return st.st_dev, st.st_ino
