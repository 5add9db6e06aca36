"""``trainguard plan`` (how often to save) and ``trainguard doctor`` (common checkpointing mistakes).

Thin: the figures come from :mod:`trainguard.reliability` (numpy: :func:`_reliability`, at a command's
first use of it), the checks from :mod:`trainguard.doctor` (imported by ``doctor``): ``--help`` imports
neither. This module parses options (durations: :mod:`trainguard.durations`) and prints tables or JSON.
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from rich.table import Table

from .. import losthours
from ..durations import format_duration, parse_duration
from . import CommandError, PipeConsole, plot_written

if TYPE_CHECKING:
    from ..reliability import Plan


def _reliability() -> Any:
    """:mod:`trainguard.reliability` (it imports numpy), imported at its first use by a command: ``trainguard
    --help`` and ``plan --help`` import no numpy (tests/test_hunt50_import50.py)."""
    from .. import reliability

    return reliability


class _Duration(click.ParamType):
    """A duration option of ``plan`` and ``doctor``: finite, and > 0 (``zero=False``) or >= 0. click's
    error names the option: ``Invalid value for '--restart': -1s: a duration >= 0 is needed (e.g. 10m)``.
    Before (polish58), ``-1s`` and ``nan`` were "cannot read ... as a duration" (no range said), and
    ``doctor`` took ``--node-mtbf 0s`` or ``--step-time 0`` without a word unless every input of the
    interval check was given."""

    name = "duration"

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        need = f"a finite duration {'>= 0' if self.zero else '> 0'} is needed (e.g. {'10m' if self.zero else '30s'})"
        text = str(value).strip()
        try:
            seconds = parse_duration(text.removeprefix("-") if text.startswith("-") else value)
        except ValueError as e:
            if _number(text) is not None:  # nan, inf, -inf: a number, not one in range
                self.fail(f"{text}: {need}", param, ctx)
            self.fail(str(e).replace(repr(text.removeprefix("-")), repr(text), 1), param, ctx)
        if text.startswith("-") and seconds or not math.isfinite(seconds) or not (seconds >= 0 if self.zero else seconds > 0):
            self.fail(f"{text}: {need}", param, ctx)
        return 0.0 if text.startswith("-") else seconds


class _Rate(click.ParamType):
    """``--node-failures-per-day``: a finite number > 0, checked as click parses it (``doctor`` without
    ``--save-stall`` took -1, 0 and nan without a word before polish58)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        rate = _number(str(value).strip())
        if rate is None:
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 < rate < math.inf:
            self.fail(f"{value}: a finite number of failures per node per day > 0 is needed (e.g. 0.0065)", param, ctx)
        return rate


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


DURATION = _Duration()
DURATION0 = _Duration(zero=True)  # --restart: 0 is an instant restart


def _failure_options(restart_required: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        opts = [
            click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="nodes in the job"),
            click.option("--node-failures-per-day", type=_Rate(), help="failures per node per day, e.g. 0.0065"),
            click.option("--node-mtbf", type=DURATION, help="or a node's mean time between failures, e.g. 400d"),
            click.option("--save-stall", type=DURATION, required=restart_required,
                         help="time training is blocked per save (async: the blocking part), e.g. 30s"),
            # No default when required: click 8.5 (tested here) takes an explicit default=None as a value, and no --restart
            # ended in make_plan's TypeError traceback instead of "Missing option".
            click.option("--restart", type=DURATION0, required=restart_required, **({} if restart_required else {"default": 0.0}),
                         help="time from a failure until training runs again, e.g. 10m"
                              + ("" if restart_required else " (default 0)")),
            click.option("--step-time", type=DURATION, help="time per training step, e.g. 2s, to express intervals in steps"),
            click.option("--gpus-per-node", type=click.IntRange(min=0), default=8, show_default=True,
                         help="for the GPU-hours lost; 0: nodes without GPUs (node-hours lost)"),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f
    return wrap


def _build_plan(nodes: int, node_failures_per_day: float | None, node_mtbf: float | None, save_stall: float,
                restart: float, step_time: float | None, gpus_per_node: int,
                intervals: dict[str, float] | None = None, save_duration: float | None = None) -> Plan:
    if (node_failures_per_day is None) == (node_mtbf is None):
        raise click.UsageError("give exactly one of --node-failures-per-day and --node-mtbf")
    try:
        return _reliability().make_plan(nodes=nodes, node_failures_per_day=node_failures_per_day, node_mtbf_s=node_mtbf,
                         stall_s=save_stall, restart_s=restart, step_time_s=step_time,
                         gpus_per_node=gpus_per_node, intervals=intervals, save_duration_s=save_duration)
    except ValueError as e:
        raise click.UsageError(_as_options(str(e))) from None
    except OverflowError:
        raise click.UsageError("the inputs are out of range (a rate or duration too large to compute with)") from None


# make_plan's parameter -> the option that sets it (durations are printed back as durations)
_OPTIONS = {"node_failures_per_day": "--node-failures-per-day", "node_mtbf_s": "--node-mtbf",
            "stall_s": "--save-stall", "restart_s": "--restart", "step_time_s": "--step-time", "nodes": "--nodes",
            "save_duration_s": "--save-duration"}


def _as_options(message: str) -> str:
    """make_plan's ``stall_s=0.0: ...`` as the CLI says it: ``--save-stall 0s: ...``."""
    def option(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        if name.endswith("_s"):
            try:
                value = format_duration(float(value))
            except ValueError:
                pass
        return f"{_OPTIONS[name]} {value}"

    return re.sub(r"\b(" + "|".join(_OPTIONS) + r")=([^\s:]+)", option, message)


def parse_every(text: str | None, step_time: float | None) -> dict[str, float]:
    """``"500,1000"`` (steps; needs a step time) or ``"10m,1h"`` (compute time) -> {label: seconds}."""
    out: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        if item.isascii() and item.isdigit():  # not "²": isdigit() says yes, int() refuses it
            if not item.strip("0"):
                raise click.UsageError("--every 0: an interval must be at least 1 step (or a duration > 0)")
            if step_time is None:
                raise click.UsageError(f"--every {item} is in steps: give --step-time too (or write e.g. 30m)")
            seconds = int(item) * step_time if len(item) < 300 else math.inf  # 1e308 steps: float's limit
            if not seconds < math.inf:
                raise click.UsageError(f"--every {item[:20]}...: too many steps to compute with")
            out[f"every {int(item)} steps"] = seconds
        else:
            if _unitless(item):  # 1000 is steps: 1e3 or 1.5 read as seconds was the other unit for the same number
                raise click.UsageError(f"--every {item}: steps are a whole number (1000), a duration has its unit "
                                       "(1.5s, 10m, 2h)")
            try:
                out[f"every {item}"] = parse_duration(item)
            except ValueError as e:
                raise click.UsageError(f"--every: {e}") from None
            if not 0 < out[f"every {item}"] < math.inf:  # 1e400 reads as inf
                raise click.UsageError(f"--every {item}: an interval must be a finite duration > 0")
    return out


def _unitless(item: str) -> bool:
    try:
        float(item)
    except ValueError:
        return False
    return True


@click.command("plan")
@_failure_options(restart_required=True)
@click.option("--every", "every", help="intervals to compare, steps or durations: 500,1000 or 10m,1h")
@click.option("--save-duration", type=DURATION, help="async saves: one save's whole duration, call to commit "
              "(trainguard report's duration), e.g. 5m; a failure before the commit loses one more interval")
@click.option("--plot", type=click.Path(dir_okay=False), help="draw efficiency against interval to this PNG")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
def plan_cmd(nodes: int, node_failures_per_day: float | None, node_mtbf: float | None, save_stall: float,
             restart: float, step_time: float | None, gpus_per_node: int, every: str | None,
             save_duration: float | None, plot: str | None, as_json: bool) -> None:
    """How often to save: failure odds, Young's and Daly's intervals, efficiency, GPU-hours lost.

    Example: trainguard plan --nodes 256 --node-failures-per-day 0.0065 --save-stall 30s --restart 10m
    --step-time 2s --every 500,1000
    """
    p = _build_plan(nodes, node_failures_per_day, node_mtbf, save_stall, restart, step_time, gpus_per_node,
                    parse_every(every, step_time), save_duration)
    if plot:
        try:
            with plot_written(plot):
                _reliability().plot_plan(p, plot)
        except ImportError:
            raise CommandError("--plot needs matplotlib: pip install matplotlib") from None
    if as_json:
        try:
            click.echo(json.dumps(losthours.with_node_hours(p.to_dict(), p), allow_nan=False))
        except ValueError:
            raise click.UsageError("the inputs are out of range: the plan's figures overflow") from None
        return
    _print_plan(p, plot, click.get_current_context().get_parameter_source("gpus_per_node") != ParameterSource.DEFAULT)


HOPELESS = 0.5  # below this efficiency at the optimum, plan says what to change instead of the interval


def _pct(p: float) -> str:
    if p < 0.001:  # 2 significant digits: odds of 1e-4 a day are not "0.0%"
        return f"{100 * p:.2g}%"
    return f"{100 * p:.1f}%" if p < 0.995 else f"{100 * p:.6g}%"


def _hopeless(p: Plan) -> str:
    """What ``trainguard plan`` prints when even the optimum wastes half the time or more: which of the
    restart and the save stall is to blame, and what to change. The efficiency factorises exactly,
    ``E = e^(-R/M) * E_0``: the restart alone keeps at most ``e^(-R/M)`` of the time (``E_0`` is the
    efficiency with an instant restart), so each cause is named only where it costs more than 10 %."""
    m = p.job_mtbf_s
    keep_restart = math.exp(-(p.restart_s + p.commit_delay_s) / m)
    keep_save = _reliability().efficiency(p.optimal_interval_s, p.stall_s, 0.0, m)
    causes, fixes = [], []
    if keep_save < 0.9:
        causes.append(f"saving (a {format_duration(p.stall_s)} stall) keeps {100 * keep_save:.2f}% even at the optimum")
        fixes.append("cut the stall with async saves (only their blocking part counts) or a RAM tier (ram_tier=True)")
    if keep_restart < 0.9:
        delay = f" plus the async commit delay ({format_duration(p.commit_delay_s)})" if p.commit_delay_s else ""
        causes.append(f"the restart ({format_duration(p.restart_s)}){delay} alone keeps at most "
                      f"{100 * keep_restart:.2f}% (e^(-restart/MTBF): failures strike restarts too)")
        fixes.append("shorten the restart (detect, reschedule and load faster)"
                     + (" and the background write" if p.commit_delay_s else ""))
    fixes.append("or run on fewer nodes")
    return (f"Even at the optimum only {100 * p.efficiency_at_optimum:.2f}% of the time is useful with a job MTBF of "
            f"{format_duration(m)}: {'; '.join(causes)}. To change it: {', '.join(fixes)}.")


def _print_plan(p: Plan, plot: str | None, gpus_given: bool = True) -> None:
    con = PipeConsole()
    t = Table(title="Failures", show_header=False)
    t.add_row("job MTBF", f"{format_duration(p.job_mtbf_s)} (node MTBF {format_duration(p.node_mtbf_s)} "
              f"/ {p.nodes} nodes)")
    t.add_row("P(>= 1 failure) per day", _pct(p.p_failure_day))
    t.add_row("P(>= 1 failure) per week", _pct(p.p_failure_week))
    per_day = 86400 / p.job_mtbf_s
    t.add_row("expected failures per day", f"{per_day:,.0f}" if per_day >= 100 else f"{per_day:.3g}")
    con.print(t)
    delay = f", commit {format_duration(p.commit_delay_s)} after the stall" if p.commit_delay_s else ""
    t = Table(title=f"Save interval (stall {format_duration(p.stall_s)}, restart {format_duration(p.restart_s)}{delay})")
    gpus, unit = losthours.per_day(p)  # node-hours for nodes without GPUs (--gpus-per-node 0)
    for col in ("interval", "compute between saves", "steps", "efficiency", f"{unit} lost / day"):
        t.add_column(col, justify="left" if col == "interval" else "right")
    rows = [("Young (first order)", p.young_interval_s, p.efficiency_at_young), ("Daly (estimate)", p.daly_interval_s, p.efficiency_at_daly),
            ("optimum (exact)", p.optimal_interval_s, p.efficiency_at_optimum)]
    rows += [(r.label, r.interval_s, r.efficiency) for r in p.rows]
    for label, tau, e in rows:
        steps = p.steps(tau)
        lost = (1 - e) * gpus  # under 100: 3 digits, as failures per day (0.25 GPU-hours a day was shown as "0")
        t.add_row(label, format_duration(tau), "-" if steps is None else f"{steps:,}", f"{100 * e:.2f}%",
                  f"{lost:,.0f}" if lost >= 100 else f"{lost:.3g}")
    con.print(t)
    rw, w = ("(R+W)", ", W the commit delay of an async save") if p.commit_delay_s else ("R", "")
    con.print("Efficiency = useful time / wall time, from the exact expected time "
              f"M·e^({rw}/M)·(e^((τ+δ)/M) − 1) per interval τ (Daly 2006){w}; see docs/planning.md.")
    if note := losthours.assumed_note(gpus_given, p):
        con.print(note)
    short = [label for label, tau, _e in rows[3:] if tau < p.commit_delay_s]  # an --every row: said nothing before
    if p.commit_delay_s > p.optimal_interval_s or short:  # the model needs one save in flight: W <= tau
        floor, steps = p.commit_delay_s + p.stall_s, p.steps(p.commit_delay_s)
        what = "the optimum interval" if p.commit_delay_s > p.optimal_interval_s else "the interval " + ", ".join(short)
        con.print(f"One async save takes {format_duration(floor)}, more than {what}: a save "
                  f"started sooner waits for the previous one (training stalls). Save no more often than every "
                  f"{format_duration(p.commit_delay_s)} of compute" + (f" ({steps:,} steps)" if steps else "")
                  + f" ({100 * p.efficiency(p.commit_delay_s):.2f}% efficiency; tg.DalyInterval keeps to one whole save, "
                  "its stall included), or make the background write faster; the efficiencies above for shorter intervals are optimistic.")
    if p.efficiency_at_optimum < HOPELESS:
        con.print(_hopeless(p))
    if plot:
        con.print(f"plot written to {plot}")


@click.command("doctor")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@_failure_options(restart_required=False)
@click.option("--amp", type=click.Choice(["float16", "bfloat16", "none"]), help="override AMP detection")
@click.option("--json", "as_json", is_flag=True, help="print the findings as a JSON list")
def doctor_cmd(script: str, nodes: int, node_failures_per_day: float | None, node_mtbf: float | None,
               save_stall: float | None, restart: float, step_time: float | None, gpus_per_node: int,
               amp: str | None, as_json: bool) -> None:
    """Check a training script for common checkpointing mistakes; exit 1 if any is an error.

    SCRIPT must define trainguard_state() returning the state dict, or (state, manager) where
    manager is a CheckpointManager or a dict with root, save, keep, async_save. Its module-level
    code runs (keep training under `if __name__ == "__main__":`); a script without the hook is not
    imported: only its source is checked, and the exit code is 1. Give the failure rate and
    --save-stall (and --step-time) to also check the save interval against the optimum.
    """
    from ..doctor import Finding, check, settings_from
    from ..doctor_source import check_source, defines_hook, read_source

    source = read_source(Path(script))
    from ..doctor_parse import notebook

    if script.endswith(".ipynb") or notebook(source):
        # A notebook's JSON is one Python expression (a dict): it parsed, no check found a thing, and the
        # table said "ok" about code it never read.
        raise CommandError(f"{script} is a Jupyter notebook: the doctor reads Python scripts; export it with "
                           f"`jupyter nbconvert --to script {script}` and run trainguard doctor on the .py file")
    try:
        tree = ast.parse(source, filename=script)
    except SyntaxError as e:  # the import would fail the same way: say so without running anything
        where = f"line {e.lineno}: " if e.lineno else ""  # NUL bytes (a binary file): no line, it said "line None"
        raise CommandError(f"{script} is not valid Python 3 ({where}{e.msg}): the doctor reads and "
                           "imports it as Python") from None
    except (RecursionError, MemoryError):  # a 50,000-term expression: Python cannot compile it either (a traceback before)
        raise CommandError(f"{script} is too deeply nested for Python's parser (an expression of thousands of terms "
                           "or levels; Python cannot compile it to run it either): build it in steps") from None
    hooked = defines_hook(tree)
    from .doctorhook import load_hook

    state, manager = load_hook(Path(script)) if hooked else ({}, None)
    plan = None
    if save_stall is not None and (node_failures_per_day is not None or node_mtbf is not None):
        plan = _build_plan(nodes, node_failures_per_day, node_mtbf, save_stall, restart, step_time, gpus_per_node)
    amp_mode: str | bool | None = False if amp == "none" else amp
    settings = settings_from(manager, plan=plan, source=source, amp=amp_mode, path=script)
    findings = check(state, settings) if hooked else check_source(settings)
    rate = node_failures_per_day is not None or node_mtbf is not None
    if plan is None and (rate or save_stall is not None or step_time is not None or restart or nodes != 1):
        # some of the plan's inputs: say what is missing (--step-time, --restart or --nodes alone said nothing)
        missing = [m for m, ok in (("the failure rate (--node-failures-per-day or --node-mtbf)", rate),
                                   ("--save-stall (the seconds a save stops training)", save_stall is not None)) if not ok]
        findings.append(Finding("interval", "info", "not checked: it needs " + " and ".join(missing)
                                + " besides what was given"))
    unhooked = (f"{script} defines no trainguard_state(), so it was not imported and only its source was checked",
                "add a trainguard_state() that returns the state dict, or (state, manager), and keep training under "
                "`if __name__ == \"__main__\":` to check the state too")
    if as_json:  # one JSON list on stdout, the refusal of a script without the hook among the findings
        extra = [] if hooked else [Finding("hook", "error", *unhooked).__dict__]
        click.echo(json.dumps([f.__dict__ for f in findings] + extra))
        if not hooked:
            sys.exit(1)
    else:
        t = Table(title=f"trainguard doctor {script}")
        for col in ("check", "status", "finding", "fix"):
            t.add_column(col, overflow="fold")
        style = {"error": "bold red", "warning": "yellow", "ok": "green", "info": "cyan"}
        for f in findings:
            t.add_row(f.check, f"[{style[f.severity]}]{f.severity}[/]", f.message, f.fix)
        PipeConsole().print(t)
    if not hooked:  # not imported: its module-level code (training, at times) never ran
        raise CommandError(f"{unhooked[0]} (above): {unhooked[1]}", exit_code=1)
    if any(f.severity == "error" for f in findings):
        sys.exit(1)
