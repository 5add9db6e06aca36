"""Local modules a training script imports, read for the doctor's source checks
(:func:`trainguard.doctor_rank.single_rank` calls :func:`imported`): DeepSpeed-Chat's
``training/step1_supervised_finetuning/main.py`` saves through ``save_hf_format``, a function of the
project's own ``dschat/utils/utils.py``.

The modules are read and parsed, never imported (nothing of them runs): only ``.py`` files found in
the script's folder or up to three folders above it (a project installed with ``pip install -e .``),
at most two imports deep and 32 files in all, each under 2 MB; a module found nowhere there
(``torch``, an installed package) is left out.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .doctor_parse import walk

V = TypeVar("V")
_UP = 3  # folders above the script searched for an absolute import
_DEPTH = 2  # imports of imports followed
_MAX_FILES = 32
_MAX_BYTES = 2_000_000


class Reads:
    """What one :func:`imported` call, and those it leads to, share: the files left to read, the results
    of those read (a module many others import is read once at each depth: one reached first through
    another module, its own imports not followed, is read again when the script imports it itself),
    and ``needle``: a module whose imports are
    not followed (the deepest) and whose text lacks it is not parsed (``"save"``: it has no save helper)."""

    def __init__(self, needle: str = "") -> None:
        self.left, self.needle = _MAX_FILES, needle
        self.done: dict[tuple[Path, int], Any] = {}  # (file, depth read at): its analysis
        self.roots: list[Path] = []  # where an absolute import is looked up: the script's folder and those above


Analyse = Callable[[ast.Module, Path, int, Reads], dict[str, V]]  # (tree, path, depth, reads) -> {name: what}


def imported(tree: ast.Module, path: str | Path | None, analyse: Analyse[V], depth: int = 0,
             reads: Reads | None = None) -> tuple[dict[str, V], frozenset[str]]:
    """What ``analyse`` finds in the local modules the file ``path`` (parsed: ``tree``) imports, under
    the names the file uses: ``from m import f as g`` gives ``{"g": analyse(m)["f"]}``; ``import m as mm``
    and ``from pkg import m`` (``m`` a module) give every name ``analyse(m)`` finds, and the module's
    name (``mm``, ``m``) among the names returned second, for calls as ``mm.f()``. ``({}, frozenset())``
    without a path, past the depth or the file budget. ``analyse`` reads a module's own imports by
    calling this again with the depth and ``reads`` it is given."""
    found: dict[str, V] = {}
    mods: set[str] = set()
    if path is None or depth >= _DEPTH:
        return found, frozenset()
    reads = Reads() if reads is None else reads
    folder = Path(path).resolve().parent
    if not reads.roots:  # as Python runs the script: an absolute import never means a module's own sibling
        reads.roots = [folder, *list(folder.parents)[:_UP]]
    for node in walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (what := _read(_module(a.name, 0, folder, reads.roots), analyse, depth, reads)) is not None:
                    found.update(what)
                    mods.add(a.asname or a.name.rsplit(".", 1)[-1])  # `import a.b.c`: called as a.b.c.f()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            what = _read(_module(base, node.level, folder, reads.roots), analyse, depth, reads) if base else None
            for a in node.names:
                if what is not None and a.name in what:
                    found[a.asname or a.name] = what[a.name]
                elif a.name != "*" and (sub := _read(_module(f"{base}.{a.name}".strip("."), node.level, folder, reads.roots),
                                                     analyse, depth, reads)) is not None:
                    found.update(sub)  # `from dschat.utils import utils`: utils.save_hf_format(...)
                    mods.add(a.asname or a.name)
                elif a.name == "*" and what is not None:
                    found.update(what)
    return found, frozenset(mods)


def _module(name: str, level: int, folder: Path, roots: list[Path]) -> Path | None:
    """The local file of module ``name`` (``level`` dots before it) imported from a file in ``folder``:
    a relative import from ``folder``, an absolute one from the first of ``roots`` that has it."""
    parts = [p for p in name.split(".") if p]
    if level:
        if level - 2 >= len(folder.parents):  # above the filesystem's root
            return None
        bases = [folder if level == 1 else folder.parents[level - 2]]
    else:
        bases = roots
    for b in bases:
        for f in (b.joinpath(*parts).with_suffix(".py") if parts else None, b.joinpath(*parts, "__init__.py")):
            if f is not None and f.is_file():
                return f
    return None


def _read(f: Path | None, analyse: Analyse[V], depth: int, reads: Reads) -> dict[str, V] | None:
    """``analyse`` of the local file ``f``; None when there is none, it is too large, it does not
    parse, or the file budget is spent."""
    if f is None:
        return None
    if (f, depth) in reads.done:
        return reads.done[f, depth]
    if reads.left <= 0:
        return None
    reads.left -= 1
    out = None
    try:
        if f.stat().st_size <= _MAX_BYTES:
            text = f.read_text(encoding="utf-8", errors="replace")
            out = {} if depth + 1 >= _DEPTH and reads.needle not in text else analyse(
                ast.parse(text, filename=str(f)), f, depth + 1, reads)
    except (OSError, SyntaxError, ValueError, RecursionError):
        pass
    reads.done[f, depth] = out
    return out
