"""``trainguard report RUN_DIR``: failures, lost work, recovery time, overhead, goodput."""

from __future__ import annotations

import json
import math
import os
import shutil

import click

from . import CommandError, check_plot_target, plot_written, printable

MAX_SPAN_S = 1e10  # seconds (317 years): more between an event log's first and last event is no run's


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="write a timeline PNG: steps over wall time, saves, failures, restores")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def report(run_dir: str, plot: str | None, as_json: bool) -> None:
    """Summarize the event log of a `trainguard run` directory."""
    from .. import report as rep

    if plot:
        plot = _check_plot(plot)
    tally = rep.tally_log(run_dir, timeline=bool(plot))  # read once, as it is now (a live run appends on)
    if not tally.events:
        raise CommandError(f"no events in {run_dir}: was it the --run-dir of `trainguard run`?")
    first, last = tally.first, tally.last  # the least and the greatest t
    # Each t is finite (read_events), their span need not be: +-1e308 printed "wall time inf s" (--json:
    # Infinity), and 1e308 among times of today a wall time of 309 digits. t is a Unix time (time.time()).
    if last - first > MAX_SPAN_S or not math.isfinite(last - first):  # this order: ints up to 2 ** 1023 (events.py)
        raise CommandError(f"the events' timestamps in {printable(run_dir)} are invalid: they run from {first:g} to "
                           f"{last:g} (a garbled event log?); remove the events whose \"t\" is no Unix time from "
                           "its events.jsonl")
    summary = rep.summary(tally, root=run_dir)  # an interrupted save committed on disk is a save
    if not as_json:  # the summary first: the plot takes seconds
        click.echo(rep.format_summary(summary))
    if plot:
        # --json: the plot before the summary, so that stdout holds one JSON document: the summary, or the error
        # object of a plot that failed (or a Ctrl-C while it is drawn). Before (review58i) the error object
        # followed the summary, and `json.loads` of stdout failed ("Extra data").
        with plot_written(plot):
            rep.plot_tally(tally, plot, title=run_dir)
        click.echo(f"timeline written to {printable(plot)}", err=as_json)  # --json: stdout holds the JSON only
    if as_json:
        click.echo(json.dumps(summary, indent=2))


def _check_plot(plot: str) -> str:
    """The file --plot ``plot`` writes (matplotlib adds ``.png`` to a name without a suffix: the
    command said it wrote ``NAME``). Refuses a suffix matplotlib cannot write (ValueError: a
    traceback) and a directory that does not exist, before the summary is printed, not after it."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:  # not a dependency of trainguard (the dev extra): a traceback, before the summary
        raise CommandError("--plot needs matplotlib: pip install matplotlib") from None

    kinds = dict(Figure().canvas.get_supported_filetypes())
    tex = matplotlib.rcParams["pgf.texsystem"]
    if shutil.which(tex) is None:  # .pgf runs it to lay out text: RuntimeError "'xelatex' not found", a traceback
        kinds.pop("pgf", None)    # after the summary (and offered below as a suffix it writes)
    suffix = os.path.splitext(plot)[1].lstrip(".").lower()
    if plot.endswith("."):  # matplotlib wrote "out." as "out..png"
        raise CommandError(f"--plot {printable(plot)}: the name ends with a dot and no suffix; name it "
                           f"{printable(plot)}png (or .svg, .pdf)")
    if suffix == "pgf" and suffix not in kinds:
        raise CommandError(f"--plot {printable(plot)}: a .pgf file needs {printable(tex)} (LaTeX), which is not "
                           "installed; name it .pdf or .svg")
    if suffix and suffix not in kinds:
        raise CommandError(f"--plot {printable(plot)}: matplotlib cannot write .{printable(suffix)} files; "
                           f"name it .png (or one of .{', .'.join(sorted(kinds))})")
    out = plot if suffix else f"{plot}.png"
    check_plot_target(out)  # a directory that does not exist, or this user may not write to
    return out
