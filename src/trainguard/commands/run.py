"""``trainguard run``: launch training under torch's elastic agent with trainguard's additions."""

from __future__ import annotations

import sys

import click


@click.command(
    "run",
    add_help_option=False,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(args: tuple[str, ...]) -> None:
    """torchrun + fault drills + hang watchdog + event log (see `trainguard run --help`)."""
    from ..elastic.launcher import main

    sys.exit(main(list(args)))
