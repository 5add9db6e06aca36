"""``trainguard ls | inspect | export``: read-only views and export (any process); ``verify`` is in ``verify.py``.

Each command imports the checkpoint modules when it runs (test_hunt50_import50.py); ``ls``, ``inspect`` and
``verify`` read manifests and checksums without torch (test_hunt51_cli51.py), ``export`` writes tensors with it."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import Any

import click
from rich.markup import escape
from rich.style import Style
from rich.table import Table

from ..gcpause import gc_paused
from ..layout import RAM_BASE
from ..storage import for_path
from . import PipeConsole, counted, printable, ram_tier_given, stdout_gone, terminated_as_interrupt
from .values import entry_values, shown

console = PipeConsole()


def _plain(v: Any) -> Any:
    """JSON-safe copy for ``--json``: tuples as lists, nan/inf as the strings "nan", "inf", "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _shown(s: Any) -> str:
    """A string from a checkpoint (names, paths, errors quoting them) as rich shows it verbatim:
    markup escaped (``[/x]`` in a tensor name made rich raise MarkupError) and control
    characters written as ``\\xNN`` (an escape sequence must not reach the terminal)."""
    return escape(printable(s))


def _print_json(value: Any, flat_below: int = 0) -> None:
    """``--json``'s output, indented by one space a level; with ``flat_below`` (``inspect``: 4,
    each tensor) every value that deep on one line: json's indenting encoder is pure Python (11 s
    for 100,000 tensors), and so is ``_plain`` (``inspect`` applies it to the metadata only)."""
    _write("".join(_json_text(value if flat_below else _plain(value), flat_below or 1 << 30)))


_ONE_LINE = json.JSONEncoder(separators=(", ", ": "), allow_nan=False)  # no indent: json's C encoder


def _json_text(v: Any, depth: int, pad: str = "\n") -> Iterator[str]:
    """The JSON text of ``v`` (``_print_json``): indented one space a level ``depth`` levels deep,
    each value below that on one line."""
    if depth == 0 or not isinstance(v, (dict, list)) or not v:
        yield _ONE_LINE.encode(v)
        return
    inner = pad + " "
    yield "{" if isinstance(v, dict) else "["
    for i, item in enumerate(v.items() if isinstance(v, dict) else v):
        yield ("," if i else "") + inner
        if isinstance(v, dict):
            yield _ONE_LINE.encode(str(item[0])) + ": "
            item = item[1]
        yield from _json_text(item, depth - 1, inner)
    yield pad + ("}" if isinstance(v, dict) else "]")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


@click.command("ls")
@click.argument("run_dir")
@click.option("--verify", "verify_data", is_flag=True, help="Also check every data checksum (reads all bytes).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (one object per step) instead of a table.")
@click.option("--ram-tier", "ram_base", default=RAM_BASE, show_default=True, metavar="DIR", callback=ram_tier_given,
              help="Where the manager's ram_tier= keeps its RAM copies (node-local: run ls on the training node).")
def ls(run_dir: str, verify_data: bool, as_json: bool, ram_base: str) -> None:
    """List the checkpoints of a run directory: step, time, size, entries, status
    (valid / corrupt / incomplete / newer format; deleted: retention removed it while it was listed),
    and the copies this node's RAM tier holds, which a restart on this node tries first."""
    from ..inspect import list_checkpoints, set_aside
    from ..ramview import ram_copies

    rows = list_checkpoints(run_dir, verify_data=verify_data)  # refuses a step directory, saying so
    ram_dir = ram_copies(run_dir, ram_base)
    ram = list_checkpoints(ram_dir, verify_data=verify_data) if ram_dir else []
    stale = _stale(run_dir, ram_dir, ram, rows) if ram_dir and ram else {}
    if as_json:  # the RAM copies after the run directory's steps, "tier" telling them apart; "stale": why a
        # restart discards that RAM copy (as the table's "stale in RAM"), null for every other row
        _print_json([{"step": r.step, "name": r.name, "path": r.path, "status": r.status, "created": r.created,
                      "bytes": r.size, "entries": r.entries, "detail": r.detail, "tier": tier,
                      "stale": stale.get(r.step) if tier == "ram" else None}
                     for tier, rs in (("durable", rows), ("ram", ram)) for r in rs])
        return
    console.print(_table(_shown(run_dir), rows))
    if not rows:
        console.print("no checkpoints")
    if ram:
        on_disk = {r.step for r in rows if r.status == "valid"}
        only = [r.step for r in ram if r.status == "valid" and r.step not in on_disk and r.step not in stale]
        console.print(_table(f"RAM tier of this node: {_shown(ram_dir)} (a restart here tries these first)", ram))
        if only:
            console.print(f"[yellow]in RAM only[/]: step(s) {', '.join(map(str, only))} not (yet) valid in the run "
                          "directory: a restart on this node resumes from them, one on another node cannot")
        for step, why in stale.items():
            console.print(f"[yellow]stale in RAM[/]: step {step}: {why}; a restart discards it")
    for note in set_aside(run_dir):  # not listed (restore does not see them now), but may come back
        console.print(f"[yellow]not listed[/]: {_shown(note)}")


def _stale(run_dir: str, ram_dir: str, ram: list[Any], rows: list[Any]) -> dict[int, str]:
    """``ls`` and ``verify``: the RAM copies (``ram``, ``list_checkpoints``'s rows of ``ram_dir``)
    that the next manager's restore discards (``ramview.stale_reason``), by step, with why."""
    from ..ramview import stale_reason

    storage, root = for_path(run_dir)
    on_disk = {r.step for r in rows if r.status not in ("incomplete", "deleted")}
    found = {r.step: stale_reason(ram_dir, storage, root, r.step, r.step in on_disk) for r in ram}
    return {step: why for step, why in found.items() if why}


def _table(title: str, rows: list[Any]) -> Table:
    """``ls``'s table of ``rows`` (``list_checkpoints``'s), of the run directory or its RAM tier."""
    table = Table(title=title)
    for col in ("step", "created", "size", "entries", "status", "detail"):
        table.add_column(col)
    for r in rows:
        created = _dt.datetime.fromtimestamp(r.created).strftime("%Y-%m-%d %H:%M:%S") if r.created else "-"
        style = {"valid": "green", "corrupt": "red", "incomplete": "yellow", "newer format": "yellow"}.get(r.status, "dim")
        table.add_row(
            str(r.step), created, _size(r.size), str(r.entries), f"[{style}]{r.status}[/]", _shown(r.detail[:80])
        )
    return table


@click.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print the checkpoint's description as JSON.")
@click.option("--filter", "globs", multiple=True, metavar="GLOB",
              help="Show only the tensors whose ENTRY/NAME matches GLOB (fnmatch, case-sensitive: "
                   "'model/*.weight', '*layers.3.*'); repeat to show the tensors any of them matches.")
def inspect_cmd(ckpt: str, as_json: bool, globs: tuple[str, ...]) -> None:
    """Show a checkpoint's entries as a tree: dtype, shape and bytes of every tensor."""
    from ..inspect import describe

    with gc_paused():  # a manifest of 100,000 tensors is millions of small objects: half its parse was the GC
        m = describe(ckpt)
        entries = _entries(m, globs)
    if as_json:
        _print_json(_description(ckpt, m, entries), flat_below=4)  # one line per tensor
        return
    console.print(
        f"[bold]{_shown(ckpt)}[/]  step {m.step}, world size {m.world_size}, layout {m.layout}, "
        f"{_size(m.total_bytes)} in {len(m.files)} file(s), format v{m.format_version}, {_shown(_clip(m.library))}, "
        f"torch {_shown(_clip(m.torch_version))}"
        + (f"; tensors matching {', '.join(map(_shown, globs))}" if globs else "")
    )
    # Plain lines drawn like rich's Tree: a Tree of 100,000 tensors took rich 40 s to render.
    bold = (lambda s: s) if not console.is_terminal or console.no_color else Style.parse("bold cyan").render
    lines, values = [], ({} if globs else entry_values(m))  # values.py: positions, counters, a scheduler's state
    for i, (key, per_rank, tensors) in enumerate(entries):
        last = i == len(entries) - 1
        lines.append(("└── " if last else "├── ") + bold(printable(key)) + ("  (per rank)" if per_rank else "")
                     + (f"  {printable(shown(values[key]))}" if key in values else ""))
        stem = "    " if last else "│   "
        lines.extend(f"{stem}{'└── ' if j == len(tensors) - 1 else '├── '}{printable(name)}  {e.dtype} "
                     f"{tuple(e.shape)}  {_size(e.nbytes)}  ({printable(_stored(e))})" for j, (name, e) in enumerate(tensors))
    if globs and not entries:
        lines.append(f"no tensor matches {', '.join(map(printable, globs))}")
    if lines:
        _write("\n".join(lines))


def _clip(s: str, n: int = 200) -> str:
    """``inspect``'s header: a version string of the manifest (``library``, ``torch``: any length a
    hand-edited one holds) cut to ``n`` characters. rich's highlighter takes time quadratic in an
    unbroken word: a 100,000-character ``library`` kept ``inspect`` busy for minutes."""
    return s if len(s) <= n else f"{s[:n]}... ({len(s)} characters)"


def _write(text: str) -> None:
    """``inspect``'s lines (after the header rich's console wrote) and ``--json``'s text, at once."""
    try:
        click.echo(text)
    except BrokenPipeError:  # `| head`: verify --json still exits with its verdict
        stdout_gone()


def _stored(e: Any) -> str:
    """How ``inspect`` says where a tensor's bytes are."""
    if e.alias is not None:  # format 3: a tie, its bytes stored once under the target's name
        return f"alias of {e.alias}: no bytes of its own"
    return f"{e.regular.parts} parts along dim {e.regular.dim}" if e.regular else f"{len(e.chunks)} chunk(s)"


def _entries(m: Any, globs: tuple[str, ...] = ()) -> list[tuple[str, bool, list[tuple[str, Any]]]]:
    """Each entry of the state: its key, whether it is saved per rank, its tensors (name in the
    entry, manifest entry); a per-rank entry shows rank 0's. With ``globs`` (``inspect --filter``)
    only the tensors whose ``KEY/NAME`` one of them matches, and only the entries holding one."""
    from ..skeleton import tensor_refs

    out = []
    for key, obj in m.objects.items():
        skel = obj.get("skeleton") if "skeleton" in obj else (obj["ranks"][0] if obj["ranks"] else {})
        found = ((p, m.tensors.get(p)) for p in tensor_refs(skel))
        tensors = [(p.split("/", 1)[-1], e) for p, e in found if e is not None]
        if globs:
            tensors = [(n, e) for n, e in tensors if any(fnmatchcase(f"{key}/{n}", g) for g in globs)]
            if not tensors:
                continue
        out.append((key, "ranks" in obj, tensors))
    return out


def _description(ckpt: str, m: Any, found: list[tuple[str, bool, list[tuple[str, Any]]]]) -> dict[str, Any]:
    """``inspect --json``: the manifest's facts and, per entry of ``found`` (``_entries``), its
    tensors (dtype, shape, bytes, how they are split) and, where it has some, its plain ``values``
    (values.py); the metadata as saved (nan/inf as strings)."""
    def split(e: Any) -> dict[str, Any]:
        if e.alias is not None:
            return {"alias": e.alias}
        return {"parts": e.regular.parts, "dim": e.regular.dim} if e.regular else {"chunks": len(e.chunks)}

    values = entry_values(m)
    entries = {key: {"per_rank": per_rank, "tensors": {name: {"dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes,
                                                                **split(e)} for name, e in tensors},
                     **({"values": _plain(values[key])} if key in values else {})}
               for key, per_rank, tensors in found}
    return {"path": ckpt, "step": m.step, "world_size": m.world_size, "layout": m.layout, "created": m.created,
            "bytes": m.total_bytes, "files": dict(m.files), "format_version": m.format_version, "library": m.library,
            "torch": m.torch_version, "metadata": _plain(m.metadata), "entries": entries}


@click.command("export")
@click.argument("ckpt")
@click.option("--to", "to", required=True, metavar="FILE",
              help="Output file on a local (or mounted) file system (a path or file:///PATH), not an object store's URL: NAME.safetensors, "
                   "or NAME.pt/.pth/.bin (torch.save); its directory must exist, an existing file is replaced.")
@click.option("--entry", default="model", show_default=True, help="Which entry of the state to export.")
def export_cmd(ckpt: str, to: str, entry: str) -> None:
    """Export model weights as a safetensors file or a torch.load(weights_only=True) file."""
    from ..export import export

    with terminated_as_interrupt(to):  # `timeout`/kill: the temporary file beside --to is removed
        n = export(ckpt, to, entry=entry)
    console.print(f"wrote {counted(n, 'tensor')} to {_shown(to)}")
