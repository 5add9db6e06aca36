"""``trainguard consolidate SRC DST``: a sharded checkpoint as one full checkpoint, offline.

Thin: :func:`trainguard.consolidate.consolidate` does the work (no process group, one batch of
tensors of up to 256 MiB in memory at a time, a larger tensor in pieces).
"""

from __future__ import annotations

import click

from . import counted, echo, printable, terminated_as_interrupt


@click.command("consolidate")
@click.argument("src")
@click.argument("dst")
@click.option("--overwrite", is_flag=True, help="Replace DST if it already holds a checkpoint.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the final line.")
def consolidate(src: str, dst: str, overwrite: bool, quiet: bool) -> None:
    """Turn the checkpoint SRC (saved by any number of ranks) into a full one at DST.

    DST holds whole tensors in one data file (layout "full"), loadable at any world size and
    by tools that expect one tensor per chunk. Memory holds one batch of tensors at a time, up to
    256 MiB (a larger tensor is read and written in pieces of 256 MiB).
    """
    from ..consolidate import consolidate as _consolidate  # torch: when the command runs, not at `--help`

    def show(path: str, nbytes: int) -> None:
        if not quiet:
            echo(f"  {printable(path)}  {nbytes} B")  # `| head`: the consolidation goes on

    with terminated_as_interrupt(dst):  # `timeout`/kill: DST's temporary directory is removed
        m = _consolidate(src, dst, overwrite=overwrite, progress=show)
    click.echo(f"consolidated {counted(len(m.tensors), 'tensor')}, {counted(m.total_bytes, 'byte')} (saved by "
               f"{counted(m.world_size, 'rank')}) into {printable(dst)}")
