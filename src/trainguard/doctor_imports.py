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
from typing import TypeVar

V = TypeVar("V")
Analyse = Callable[[ast.Module, Path, int, list[int]], dict[str, V]]  # (tree, path, depth, budget) -> {name: what}
_UP = 3  # folders above the script searched for an absolute import
_DEPTH = 2  # imports of imports followed
_MAX_FILES = 32
_MAX_BYTES = 2_000_000


def imported(tree: ast.Module, path: str | Path | None, analyse: Analyse[V], depth: int = 0,
             budget: list[int] | None = None) -> tuple[dict[str, V], frozenset[str]]:
    """What ``analyse`` finds in the local modules the file ``path`` (parsed: ``tree``) imports, under
    the names the file uses: ``from m import f as g`` gives ``{"g": analyse(m)["f"]}``; ``import m as mm``
    and ``from pkg import m`` (``m`` a module) give every name ``analyse(m)`` finds, and the module's
    name (``mm``, ``m``) among the names returned second, for calls as ``mm.f()``. ``({}, frozenset())``
    without a path, past the depth or the file budget. ``analyse`` reads a module's own imports by
    calling this again with the depth and ``budget`` (the files left to read, shared) it is given."""
    found: dict[str, V] = {}
    mods: set[str] = set()
    if path is None or depth >= _DEPTH:
        return found, frozenset()
    budget = [_MAX_FILES] if budget is None else budget
    folder = Path(path).resolve().parent
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (what := _read(_module(a.name, 0, folder), analyse, depth, budget)) is not None:
                    found.update(what)
                    mods.add(a.asname or a.name.rsplit(".", 1)[-1])  # `import a.b.c`: called as a.b.c.f()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            what = _read(_module(base, node.level, folder), analyse, depth, budget) if base else None
            for a in node.names:
                if what is not None and a.name in what:
                    found[a.asname or a.name] = what[a.name]
                elif a.name != "*" and (sub := _read(_module(f"{base}.{a.name}".strip("."), node.level, folder),
                                                     analyse, depth, budget)) is not None:
                    found.update(sub)  # `from dschat.utils import utils`: utils.save_hf_format(...)
                    mods.add(a.asname or a.name)
                elif a.name == "*" and what is not None:
                    found.update(what)
    return found, frozenset(mods)


def _module(name: str, level: int, folder: Path) -> Path | None:
    """The local file of module ``name`` (``level`` dots before it) imported from a file in ``folder``."""
    parts = [p for p in name.split(".") if p]
    if level:
        if level - 2 >= len(folder.parents):  # above the filesystem's root
            return None
        bases = [folder if level == 1 else folder.parents[level - 2]]
    else:
        bases = [folder, *list(folder.parents)[:_UP]]
    for b in bases:
        for f in (b.joinpath(*parts).with_suffix(".py") if parts else None, b.joinpath(*parts, "__init__.py")):
            if f is not None and f.is_file():
                return f
    return None


def _read(f: Path | None, analyse: Analyse[V], depth: int, budget: list[int]) -> dict[str, V] | None:
    """``analyse`` of the local file ``f``; None when there is none, it is too large, it does not
    parse, or the file budget is spent."""
    if f is None or budget[0] <= 0:
        return None
    budget[0] -= 1
    try:
        if f.stat().st_size > _MAX_BYTES:
            return None
        tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"), filename=str(f))
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    return analyse(tree, f, depth + 1, budget)
