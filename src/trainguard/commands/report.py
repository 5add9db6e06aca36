"""``trainguard report RUN_DIR``: failures, lost work, recovery time, overhead, goodput."""

from __future__ import annotations

import json

import click

from . import CommandError


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="write a timeline PNG: steps over wall time, saves, failures, restores")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def report(run_dir: str, plot: str | None, as_json: bool) -> None:
    """Summarize the event log of a `trainguard run` directory."""
    from .. import report as rep

    events = rep.load(run_dir)
    if not events:
        raise CommandError(f"no events in {run_dir}: was it the --run-dir of `trainguard run`?")
    summary = rep.summarize(events)
    click.echo(json.dumps(summary, indent=2) if as_json else rep.format_summary(summary))
    if plot:
        rep.plot_timeline(events, plot, title=run_dir)
        click.echo(f"timeline written to {plot}")
