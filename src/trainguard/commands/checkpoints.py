"""``trainguard ls | inspect | verify | export``: read-only views and export (any process)."""

from __future__ import annotations

import datetime as _dt
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from ..commit import read_manifest
from ..errors import CheckpointError
from ..flatten import tensor_refs
from ..inspect import describe, list_checkpoints, verify
from ..storage import for_path

console = Console()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


@click.command("ls")
@click.argument("run_dir")
@click.option("--verify", "verify_data", is_flag=True, help="Also check every data checksum (reads all bytes).")
def ls(run_dir: str, verify_data: bool) -> None:
    """List the checkpoints of a run directory: step, time, size, entries, status
    (valid / corrupt / incomplete)."""
    rows = list_checkpoints(run_dir, verify_data=verify_data)
    table = Table(title=run_dir)
    for col in ("step", "created", "size", "entries", "status", "detail"):
        table.add_column(col)
    for r in rows:
        created = _dt.datetime.fromtimestamp(r.created).strftime("%Y-%m-%d %H:%M:%S") if r.created else "-"
        style = {"valid": "green", "corrupt": "red", "incomplete": "yellow"}.get(r.status, "")
        table.add_row(
            str(r.step), created, _size(r.size), str(r.entries), f"[{style}]{r.status}[/]", r.detail[:80]
        )
    console.print(table)
    if not rows:
        console.print("no checkpoints")


@click.command("inspect")
@click.argument("ckpt")
def inspect_cmd(ckpt: str) -> None:
    """Show a checkpoint's entries as a tree: dtype, shape and bytes of every tensor."""
    m = describe(ckpt)
    tree = Tree(
        f"[bold]{ckpt}[/]  step {m.step}, world size {m.world_size}, layout {m.layout}, "
        f"{_size(m.total_bytes)} in {len(m.files)} file(s), format v{m.format_version}, {m.library}, torch {m.torch_version}"
    )
    for key, obj in m.objects.items():
        node = tree.add(f"[bold cyan]{key}[/]" + ("  (per rank)" if "ranks" in obj else ""))
        skel = obj.get("skeleton") if "skeleton" in obj else (obj["ranks"][0] if obj["ranks"] else {})
        for p in tensor_refs(skel):
            e = m.tensors.get(p)
            if e is None:
                continue
            node.add(f"{p.split('/', 1)[-1]}  {e.dtype} {tuple(e.shape)}  {_size(e.nbytes)}  ({f'{e.regular.parts} parts along dim {e.regular.dim}' if e.regular else f'{len(e.chunks)} chunk(s)'})")
    console.print(tree)


@click.command("verify")
@click.argument("path")
def verify_cmd(path: str) -> None:
    """Check every checksum of a checkpoint, or of every checkpoint in a run directory.
    Exit code 0 only when everything matches."""
    storage, p = for_path(path)
    try:
        read_manifest(storage, p)
        targets = [p]
    except CheckpointError:
        rows = list_checkpoints(path)
        if not rows:
            raise
        targets = [r.path for r in rows]
    ok = True
    for t in targets:
        res = verify(t)
        ok &= res.ok
        if res.ok:
            console.print(f"[green]OK[/]      {t}  ({_size(res.bytes_checked)} checked)")
        else:
            console.print(f"[red]CORRUPT[/] {t}")
            for e in res.errors[:20]:
                console.print(f"        {e}")
    sys.exit(0 if ok else 1)


@click.command("export")
@click.argument("ckpt")
@click.option("--to", "to", required=True, help="Output file: NAME.safetensors or NAME.pt")
@click.option("--entry", default="model", show_default=True, help="Which entry of the state to export.")
def export_cmd(ckpt: str, to: str, entry: str) -> None:
    """Export model weights as a safetensors file or a torch.load(weights_only=True) file."""
    from ..export import export

    n = export(ckpt, to, entry=entry)
    console.print(f"wrote {n} tensors to {to}")
