"""``trainguard demo``: kill a training run, resume it, prove nothing was lost."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

import click

from . import CommandError, Terminated, echo, raise_terminated_on_sigterm, restore_sigterm

DEFAULT_PLOT = "trainguard-demo-timeline.png"


@click.command("demo")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True, help="training steps of each run")
@click.option("--fault-step", type=int, default=743, show_default=True, help="kill rank 1 after this step")
@click.option("--save-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="async checkpoint every N steps")
@click.option("--size", type=click.Choice(["demo", "tiny"]), default="demo", show_default=True,
              help="model size (demo: ~3.3M parameters; tiny: for tests)")
@click.option("--plot", default=DEFAULT_PLOT, show_default=True,
              help="timeline PNG (needs matplotlib; without it the default one is left out); '' for none")
@click.option("--keep", is_flag=True, help="keep the run directories (printed) instead of removing them")
@click.option("--spawn", is_flag=True,
              help="workers are new interpreters running the script (`trainguard run --start-method spawn`), "
                   "instead of the default: the script run in forked workers (`trainguard run --run-path`)")
@click.option("--start-method", type=click.Choice(["fork", "forkserver"]), default="fork", show_default=True,
              help="without --spawn: fork the agent, or fork a clean server that preloaded torch")
def demo(steps: int, fault_step: int, save_every: int, size: str, plot: str, keep: bool, spawn: bool,
         start_method: str) -> None:
    """Train a tiny GPT on the stdlib's sources twice (with a kill at --fault-step, and without)
    under `trainguard run`, then compare: lost steps, recovery time, save stall, goodput, and
    whether the final weights are bit-identical."""
    from ..demo.driver import run_demo
    from .report import _check_plot

    if plot == DEFAULT_PLOT and not _has_matplotlib():
        # matplotlib is not a dependency: the default timeline had ended a run that went well in a
        # ModuleNotFoundError traceback (exit 1), after the minutes of training
        echo(f"(no timeline: matplotlib is not installed; `pip install matplotlib` draws {DEFAULT_PLOT})")
        plot = ""
    elif plot:  # asked for: refused before the training, not after it (report --plot's checks)
        plot = _check_plot(plot)
    try:
        with _terminated_stops_the_runs():
            out = run_demo(steps=steps, fault_step=fault_step, save_every=save_every, size=size, plot=plot,
                           keep=keep, spawn=spawn, start_method=start_method, echo=echo)
    except Terminated:  # --keep: the directories stay (run_demo printed where); it said "removed" of them
        click.echo("terminated: the demo's runs were stopped" + ("" if keep else " and their directories removed"),
                   err=True)
        sys.exit(143)
    except KeyboardInterrupt:  # Ctrl-C: run_demo stopped its runs first; click's "Aborted!" exited 1, a failed demo's code
        click.echo("interrupted: the demo's runs were stopped" + ("" if keep else " and their directories removed"),
                   err=True)
        sys.exit(130)
    except ValueError as e:  # out-of-range options (--fault-step beyond --steps): a usage error
        raise CommandError(str(e)) from e
    except RuntimeError as e:  # a training run failed: the demo ran and failed, as a non-identical result
        head, _, tail = str(e).partition("\n")  # "the kill run failed (...); its log ends with:", then the log's lines
        raise CommandError(head, exit_code=1, detail=tail) from e
    sys.exit(0 if out["identical"] else 1)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _terminated_stops_the_runs() -> Iterator[None]:
    """SIGTERM (``kill PID``, ``timeout``, a scheduler's stop) raises :class:`Terminated` in the
    main thread, so that the run in progress is stopped (``demo.driver.stop``) and the run
    directories are removed, as on Ctrl-C. Python's default ended the demo alone. Further
    SIGTERMs are ignored until the demo exits (stop() is bounded: SIGKILL after 60 s): SIG_DFL
    ended the demo at once, and one that came before the agent was sent its SIGTERM (Popen.wait
    waits 0.25 s for the child on a KeyboardInterrupt, which Terminated is, before stop() runs)
    left the agent and its workers training on. A SIGTERM the process inherited ignored stays ignored."""
    old = raise_terminated_on_sigterm(then=signal.SIG_IGN)
    try:
        yield
    finally:
        restore_sigterm(old)
