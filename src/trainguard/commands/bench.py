"""``trainguard bench DIR``: measure a checkpoint's save stall, save duration and load time on
this machine and DIR's storage, for ``trainguard plan``. The figures come from
:mod:`trainguard.selfbench`; this module parses options and prints a table or JSON."""

from __future__ import annotations

import datetime
import json
import os
import sys

import click
from rich.table import Table

from . import (
    NOT_INSTALLED,
    CommandError,
    PipeConsole,
    Terminated,
    failed,
    raise_terminated_on_sigterm,
    restore_sigterm,
)

_ROWS = (
    ("raw_write_s", "limit: raw write+fsync"),
    ("sync_save_s", "sync save (durable)"),
    ("async_call_s", "async: the call"),
    ("async_step_wait_s", "async: step() waits"),
    ("async_stall_s", "async: stall, both"),
    ("async_duration_s", "async: call to commit"),
    ("load_cached_s", "load, files cached"),
    ("load_cold_s", "load, files not cached"),
    ("load_s", "load"),
)


@click.command("bench")
@click.argument("directory")
@click.option("--size", default="1GiB", show_default=True, callback=lambda ctx, param, text: _size(text),
              help="state size: fp32 weights + Adam's two moments, e.g. 500MB, 4GiB")
@click.option("--rounds", type=click.IntRange(min=1, max=100), default=3, show_default=True,
              help="measured rounds, after a first round that is shown apart (its new buffers and files "
                   "are a job's first save only)")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="where the state lives (cuda: async saves stage into pinned host memory)")
@click.option("--keep", is_flag=True, help="keep the last round's two checkpoints (their paths are printed)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
def bench(directory: str, size: int, rounds: int, device: str, keep: bool, as_json: bool) -> None:
    """Measure what a checkpoint costs here: save stall, save duration and load time of a
    model + Adam state of --size in DIRECTORY (local or an fsspec URL), against the storage's
    raw write speed, and print the `trainguard plan` options they give.

    Example: trainguard bench /scratch/ckpts --size 4GiB. Under torchrun
    (torchrun --nproc-per-node 8 $(which trainguard) bench DIR) every rank saves its own --size
    state at the same time, as a job's ranks do.
    """
    import torch

    from .. import selfbench
    from ..errors import CheckpointError

    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda: torch sees no CUDA device here; use --device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nbytes = size
    try:
        selfbench.check_room(directory, nbytes, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), world)
    except (selfbench.BenchError, OSError) as e:
        raise CommandError(str(e)) from None
    dist = torch.distributed
    own_group = world > 1 and not dist.is_initialized()
    if own_group:  # under torchrun: every rank saves its own state at once
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank() if world > 1 else 0
    console = PipeConsole(stderr=as_json, quiet=rank != 0)

    def progress(r: int, fig: dict[str, float]) -> None:
        what = f"round {r}/{rounds}" if r else "first round (not in the medians)"
        console.print(f"{what}: " + ", ".join(f"{k} {v:.3f}" for k, v in fig.items()))

    old_term: object = NOT_INSTALLED
    try:
        old_term = raise_terminated_on_sigterm()
        result = selfbench.run(directory, nbytes, rounds=rounds, device=device, keep=keep, progress=progress)
    except (selfbench.BenchError, CheckpointError) as e:  # a load gave back other bytes; a save failed
        raise CommandError(str(e), exit_code=1) from None
    except PermissionError as e:
        raise CommandError(f"cannot write in {directory}: {e}") from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: selfbench.run cleaned up first (selfbench.Interrupted)
        left = getattr(e, "left", [])
        term = isinstance(e, Terminated) or isinstance(e.__cause__, Terminated)
        what = f"left {', '.join(left)}" if left else "its files are removed"
        if rank == 0 and as_json:  # one JSON object on stdout, as every --json error (commands.failed); before
            # (review58i) a Ctrl-C of `bench --json` left stdout empty, its one line on stderr
            failed(f"`trainguard bench` stopped before it finished: {what}", 143 if term else 130,
                   "terminated" if term else "interrupted", True)
        if rank == 0:
            click.echo(("terminated" if term else "interrupted") + ": " + what, err=True)
        sys.exit(143 if term else 130)
    finally:
        restore_sigterm(old_term)
        if own_group:
            dist.destroy_process_group()
    if rank != 0:
        return
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=1))
        return
    gb = result.state_bytes / 1e9
    total = gb * result.world  # the rates: every rank's bytes
    summary = result.summary()
    ranks = f" on each of {result.world} ranks at once (the slowest rank's figures)" if result.world > 1 else ""
    table = Table(title=f"{directory}: {gb:.2f} GB in {result.tensors} tensors on {device}{ranks}, seconds")
    for col in ("", "first round", "median [min-max]" if rounds > 1 else "measured",
                "GB/s" + (" (all)" if result.world > 1 else "")):
        table.add_column(col)
    for key, label in _ROWS:
        if key in summary:
            s = summary[key]
            spread = f"{s['median']:.3f}" + (f" [{s['min']:.3f}-{s['max']:.3f}]" if rounds > 1 else "")
            rate = f"{total / s['median']:.2f}" if key in ("raw_write_s", "sync_save_s", "load_cached_s", "load_cold_s", "load_s") else ""
            table.add_row(label, f"{s['first']:.3f}", spread, rate)
    console.print(table)
    console.print(f"for `trainguard plan`: {result.plan_flags()}")
    if result.kept:
        console.print("kept: " + " and ".join(result.kept))


def _size(text: str) -> int:
    """``--size``: bytes, or click's usage error (exit 2) saying what to write."""
    from .. import selfbench

    try:
        return selfbench.parse_size(text)
    except selfbench.BenchError as e:
        raise click.BadParameter(str(e)) from None
