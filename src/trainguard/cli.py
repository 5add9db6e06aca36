"""The ``trainguard`` command. Thin: every command calls into the library modules.

Commands live in small modules under :mod:`trainguard.commands`; each exposes click commands
that :func:`main` registers. Errors derived from :class:`CheckpointError` are printed as one
clear line (exit code 2), never as a traceback from deep inside the library; so is an OSError (a
file the user may not read, an I/O error), with what to do for a permission error, and an error of
an object store's client library (an endpoint that does not answer, missing credentials).
"""

from __future__ import annotations

import errno
import importlib
import pkgutil
import sys

import click

from .commands import printable, stdout_gone
from .errors import CheckpointError

# Packages whose exceptions (not OSErrors) say an object store could not be used: botocore's
# EndpointConnectionError, NoCredentialsError, ...; their tracebacks say nothing more to an operator.
_STORE_CLIENTS = frozenset({"botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "azure", "adlfs"})


class _Group(click.Group):
    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except CheckpointError as e:
            click.echo(f"error: {printable(e)}", err=True)  # a path from the command line: no control characters
            sys.exit(2)
        except OSError as e:  # a file the command cannot read (permissions, EIO): one line, not a traceback
            if e.errno == errno.EPIPE:  # output piped into `head`, written after the work was done: as `ls | head`
                stdout_gone()
                sys.exit(0)
            if getattr(e, "remote", False):  # an object store's HTTP error (FsspecStorage): no file, no errno of its own
                _store_failed(e)
            click.echo(f"error: {_os_error(e)}", err=True)
            sys.exit(2)
        except Exception as e:  # an object store's client: unreachable endpoint, no credentials
            if type(e).__module__.split(".")[0] not in _STORE_CLIENTS:
                raise
            _store_failed(e)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Each command's whole first sentence, wrapped: click cuts it at the terminal width ("...").
        rows = [(name, cmd.get_short_help_str(limit=300)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _store_failed(e: Exception) -> None:
    """``_Group.invoke``'s one line for an object store's error (s3fs's "Please reduce your request
    rate." alone named neither the store nor the cause), then exit 2."""
    click.echo(f"error: the object store failed: {type(e).__name__}: {printable(e)} (check its endpoint, "
               "e.g. AWS_ENDPOINT_URL, and the credentials, or try again: docs/storage.md)", err=True)
    sys.exit(2)


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
