"""The ``trainguard`` command. Thin: every command calls into the library modules.

Commands live in small modules under :mod:`trainguard.commands`; each exposes click commands
that :func:`main` registers. click's usage errors (an unknown option, a missing argument, a value
out of range) are one ``error:`` line with the command's usage, exit code 2; a Ctrl-C is one ``interrupted:``
line, exit code 130 (click's "Aborted!" exited 1, ``verify``'s code for a corrupt checkpoint). Errors derived from :class:`CheckpointError` are printed as one
clear line (exit code 2), never as a traceback from deep inside the library; so is an OSError (a
file the user may not read, an I/O error), with what to do for a permission error, and an error of
an object store's client library (an endpoint that does not answer, missing credentials). With
``--json`` (a command that has it), each of these errors is one JSON object on stdout instead,
``{"error": ..., "kind": ..., "exit_code": ...}``, with the same exit code (:func:`commands.failed`).
"""

from __future__ import annotations

import errno
import importlib
import pkgutil
import sys
from typing import Any

import click

from .commands import CommandError, failed, printable, stdout_gone, wants_json
from .errors import CheckpointError, SettingError, is_store_client_error

# click 8.2's error for a group called without a command (the help, exit 2). click 8.1 (which
# pyproject allows) has no such class: there the help exits 0 through click's Exit, and naming the
# class in an ``except`` raised AttributeError for every error and exit (``--help`` included).
_NO_ARGS_HELP: type[Exception] | tuple[()] = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _Group(click.Group):
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        """click's, for the options before the command (``trainguard --bogus``): a usage error as one line."""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _NO_ARGS_HELP:  # `trainguard` alone: the help, as click shows it
            raise
        except click.UsageError as e:
            raise _usage(e) from None

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        as_json = wants_json(self, ctx)  # `--json` given to a command that has it: its errors are JSON on stdout
        try:
            return super().invoke(ctx)
        except _NO_ARGS_HELP:
            raise
        except click.UsageError as e:  # a command's options and arguments (unknown, missing, out of range)
            name = ctx.invoked_subcommand  # the command being parsed: click's parser errors carry no context
            cmd = self.get_command(ctx, name) if name and e.ctx is None else None
            err = _usage(e, click.Context(cmd, info_name=name, parent=ctx) if cmd else ctx)
            err.as_json, err.kind = as_json, "usage"
            raise err from None
        except CommandError as e:  # a command's own refusal: click's main shows it (CommandError.show)
            e.as_json = as_json
            raise
        except KeyboardInterrupt:  # Ctrl-C in a command without its own handling (verify, ls, inspect, report, ...)
            # click's "Aborted!" exited 1: verify's code for a corrupt checkpoint, so a script took a Ctrl-C
            # (or a scheduler's SIGINT) for corruption. 130 as the writing commands (terminated_as_interrupt).
            cmd = f"{ctx.command_path} {ctx.invoked_subcommand or ''}".rstrip()
            if not as_json:
                click.echo("", err=True)
            failed(f"`{cmd}` stopped before it finished", 130, "interrupted", as_json, prefix="interrupted")
        except (CheckpointError, SettingError) as e:  # SettingError: a malformed TRAINGUARD_* variable, input too
            failed(printable(e), 2, type(e).__name__, as_json)  # a path from the command line: no control characters
        except OSError as e:  # a file the command cannot read (permissions, EIO): one line, not a traceback
            if e.errno == errno.EPIPE:  # output piped into `head`, written after the work was done: as `ls | head`
                stdout_gone()
                sys.exit(0)
            if getattr(e, "remote", False):  # an object store's HTTP error (FsspecStorage): no file, no errno of its own
                _store_failed(e, as_json)
            failed(_os_error(e), 2, type(e).__name__, as_json)
        except Exception as e:  # an object store's client: unreachable endpoint, no credentials
            if not is_store_client_error(e):
                raise
            _store_failed(e, as_json)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Each command's whole first sentence, wrapped: click cuts it at the terminal width ("...").
        rows = [(name, cmd.get_short_help_str(limit=300)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _usage(e: click.UsageError, fallback: click.Context | None = None) -> CommandError:
    """``_Group``'s one ``error:`` line (exit 2) for click's usage error ``e``, which click showed as
    a ``Usage:`` line, a ``Try ... --help`` line, a blank line and ``Error: ...``: the message, the
    usage of the command it is about (``fallback``'s when ``e`` has no context) and where its help is."""
    ctx = e.ctx or fallback
    where = f" (usage: {ctx.get_usage().removeprefix('Usage: ')}; see `{ctx.command_path} --help`)" if ctx else ""
    return CommandError(" ".join(e.format_message().split()) + where, 2)


def _store_failed(e: Exception, as_json: bool = False) -> None:
    """``_Group.invoke``'s one line for an object store's error (s3fs's "Please reduce your request
    rate." alone named neither the store nor the cause), then exit 2."""
    failed(f"the object store failed: {type(e).__name__}: {printable(e)} (check its endpoint, e.g. AWS_ENDPOINT_URL, "
           "and the credentials, or try again: docs/storage.md)", 2, "store", as_json)


def _os_error(e: OSError) -> str:
    """``_Group.invoke``'s line for an OSError: the file and the system's reason, and for a
    permission error what to do (the checkpoints are another user's: a job's service account)."""
    where = f"{printable(e.filename)}: " if e.filename is not None else ""
    text = f"{where}{e.strerror or e}"
    if e.errno in (errno.EACCES, errno.EPERM):
        text += " (run the command as the user that wrote the checkpoints, or give this one read access)"
    return text


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trainguard")
def main() -> None:
    """trainguard: checkpointing and fault tolerance for PyTorch training."""


def _register() -> None:
    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, click.Command) and getattr(obj.callback, "__module__", None) == mod.__name__:
                main.add_command(obj)


_register()


if __name__ == "__main__":  # python -m trainguard.cli ...: the same command as `trainguard ...`
    main(prog_name="trainguard")
