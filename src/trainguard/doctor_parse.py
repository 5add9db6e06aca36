"""The training script's syntax tree, parsed once for all of the doctor's checks.

``trainguard doctor`` and :func:`trainguard.doctor` run some thirty static checks on one script
(:mod:`trainguard.doctor_source` and the ``doctor_*`` modules it calls). Each parsed the text
again: 17 parses took ~12 s of a 16,000-line script's check. The checks only read the tree, so
they share one parse: :func:`parse` keeps the trees of the last few sources. It never raises:
a source Python cannot parse (a syntax error, a NUL byte, nesting too deep for the parser) gives
None, and each check then skips, as it did for a syntax error; :func:`unparsable` says why, for
the finding :func:`trainguard.doctor.check` adds.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator


@functools.lru_cache(maxsize=4)
def _parse(source: str) -> ast.Module | str:
    try:
        return ast.parse(source)
    except SyntaxError as e:
        return f"line {e.lineno}: {e.msg}" if e.lineno else str(e.msg)
    except ValueError as e:  # NUL bytes
        return str(e)
    except (RecursionError, MemoryError):  # an expression of thousands of terms or levels
        return "too deeply nested for Python's parser"


def parse(source: str | None) -> ast.Module | None:
    """The tree of ``source`` (shared: callers must not change it), or None if it does not parse."""
    tree = _parse(source or "")
    return tree if isinstance(tree, ast.Module) else None


def notebook(source: str) -> bool:
    """Whether ``source`` is a Jupyter notebook's JSON (``trainguard doctor`` and ``tg.doctor`` refuse it):
    it parses as one Python dict, so every static check ran on no code and found nothing."""
    return source.lstrip().startswith("{") and '"cells"' in source


def unparsable(source: str | None) -> str | None:
    """Why ``source`` does not parse, or None if it does (or there is none)."""
    if source is None:
        return None
    tree = _parse(source)
    return None if isinstance(tree, ast.Module) else tree


def walk(node: ast.AST) -> tuple[ast.AST, ...] | Iterator[ast.AST]:
    """``ast.walk(node)``; for a whole module, a tuple kept on the tree after its first walk (the
    checks walk one script's tree some thirty times: ~0.2 s each for a 16,000-line script)."""
    if not isinstance(node, ast.Module):
        return ast.walk(node)
    nodes = node.__dict__.get("_tg_nodes")
    if nodes is None:
        nodes = node._tg_nodes = tuple(ast.walk(node))  # type: ignore[attr-defined]
    return nodes
