"""``trainguard convert SRC DST``: between trainguard checkpoints and torch.save / safetensors
files and torch.distributed.checkpoint directories (offline, one process)."""

from __future__ import annotations

import warnings

import click

FORMATS = ["trainguard", "torch", "safetensors", "dcp"]


@click.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--from", "src_format", type=click.Choice(FORMATS), help="Source format (default: detected).")
@click.option(
    "--to", "dst_format", type=click.Choice(FORMATS),
    help="Output format (default: from DST's name: .safetensors, .pt/.pth/.bin, else a trainguard directory).",
)
@click.option(
    "--entry", default=None,
    help="Entry to export, or the entry an imported flat file becomes (default: model). '*' with --to dcp: "
    "every entry. Importing DCP: a name puts every key into that entry; without one (or with '*') each key's "
    "first name is its entry.",
)
def convert_cmd(src: str, dst: str, src_format: str | None, dst_format: str | None, entry: str | None) -> None:
    """Convert a checkpoint between trainguard, torch.save (.pt), safetensors and DCP.

    An existing .safetensors/.pt DST file is replaced (whole, when the new one is complete); a DST
    directory that holds a checkpoint (trainguard, DCP) is refused. Examples:

    \b
      trainguard convert ckpts/run1/step-000000700 model.safetensors
      trainguard convert ckpts/run1/step-000000700 out_dcp --to dcp --entry '*'
      trainguard convert weights.pt ckpts/imported/step-000000000
      trainguard convert dcp_dir ckpts/imported/step-000000000   (DCP metadata is a pickle: trusted sources only)
      trainguard convert hf_model/model.safetensors.index.json ckpts/imported/step-000000000
    """
    from ..convert import convert
    from . import counted, printable, terminated_as_interrupt

    with terminated_as_interrupt(dst), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = convert(src, dst, src_format=src_format, dst_format=dst_format,
                      entry=None if entry == "*" else ("model" if entry is None else entry),
                      dcp_split=entry in (None, "*"))  # '*' importing DCP: every entry, split as by default
    for w in caught:
        click.echo(f"warning: {w.message}", err=True)
    click.echo(f"converted {counted(res['tensors'], 'tensor')}: {res['from']} {printable(src)} -> {res['to']} {printable(dst)}")
    if res["skipped"]:
        n = len(res["skipped"])
        click.echo(f"skipped {n} DCP {'entry that is' if n == 1 else 'entries that are'} neither tensors nor JSON values: {res['skipped'][:10]}", err=True)
