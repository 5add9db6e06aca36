"""A ``DataLoader`` that only evaluation passes iterate, for the doctor's "data randomness" check.

A loader without ``generator=`` draws its base seed from the global torch generator each time its
iterator starts. That breaks a resume only for a loader iterated *across* a save: the resumed run
starts its iterator right after the restore, where the uninterrupted run started it at the epoch's
start. A validation loader whose passes hold no save and no training (``for x, y in val_loader``
with neither ``save``/``backward``/``step`` in its body, nor a call to a function of the script
that has one) starts each iterator at the same point of the global stream in both runs, and
``tg.RNGState`` saves that stream: a resume stays bit-identical (a comprehension or generator
expression over the loader, ``sum(... for x, y in val_loader)``, is such a pass too) (not with ``persistent_workers=``
anything but a literal false value, nor ``**kwargs``: persistent workers are seeded once, at the
process's first pass, and a resumed process makes that pass later in the stream) (a val loader without
``generator=``, a dropout model, resumed mid-epoch: same weights and validation losses as the
uninterrupted run). Before, such a loader was reported as well.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from .doctor_parse import walk

_TRAINS = {"save", "backward", "step", "restore", "load", "save_state", "load_state"}
_WRAPS = {"enumerate", "tqdm", "iter", "zip"}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _trainers(tree: ast.Module) -> set[str]:
    """Names of the script's functions whose bodies (or functions they call) save, restore or train."""
    defs = {n.name: n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out: set[str] = set()
    while True:
        more = {name for name, d in defs.items() if name not in out and _trains(d.body, out)}
        if not more:
            return out
        out |= more


def _trains(body: list[ast.stmt], trainers: set[str]) -> bool:
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and (_name(n.func) in _TRAINS or _name(n.func) in trainers):
                return True
    return False


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {c: p for p in walk(tree) for c in ast.iter_child_nodes(p)}


def _pass_uses(scope: ast.AST, name: str, up: dict[ast.AST, ast.AST], defs: Mapping[str, ast.AST],
               trainers: set[str], depth: int) -> bool | None:
    """Whether every read of ``name`` in ``scope`` is a pass (None: no read at all)."""
    uses = [n for n in ast.walk(scope) if isinstance(n, (ast.Name, ast.Attribute)) and _name(n) == name
            and isinstance(n.ctx, ast.Load)]
    if not uses:
        return None
    for use in uses:
        node, parent = use, up.get(use)
        while isinstance(parent, ast.Call) and _name(parent.func) in _WRAPS and node in parent.args:
            node, parent = parent, up.get(parent)
        if isinstance(parent, ast.For) and parent.iter is node:
            if _trains(parent.body, trainers):
                return False
            continue
        if isinstance(parent, ast.comprehension) and parent.iter is node:
            # sum(loss(model(x), y).item() for x, y in val_loader): the whole expression is the pass
            # (before, such a pass was not recognised, and the loader reported as a training one)
            if _trains([up[parent]], trainers):  # type: ignore[list-item]
                return False
            continue
        if isinstance(parent, ast.Call) and _name(parent.func) == "len":
            continue
        if isinstance(parent, ast.Call) and depth == 0 and node in parent.args:
            fn = defs.get(_name(parent.func) or "")
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return False
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            if params and params[0] in ("self", "cls") and isinstance(parent.func, ast.Attribute):
                params = params[1:]
            i = parent.args.index(node)
            if i >= len(params) or _pass_uses(fn, params[i], up, defs, trainers, 1) is not True:
                return False
            continue
        return False
    return True


def pass_only(tree: ast.Module, call: ast.Call) -> bool:
    """Whether the ``DataLoader(...)`` call ``call`` is assigned to a name that the script only
    iterates in passes that neither save nor train (directly, or handed to a function of the
    script that iterates it so), at least once."""
    if any(k.arg in ("persistent_workers", None) and not (isinstance(k.value, ast.Constant) and not k.value.value)
           for k in call.keywords):
        return False  # persistent workers are seeded at the process's first pass, which a resume moves
    up, defs, trainers = _facts(tree)
    assign = up.get(call)
    if not isinstance(assign, ast.Assign) or len(assign.targets) != 1:
        return False
    name = _name(assign.targets[0])
    if name is None:
        return False
    return _pass_uses(tree, name, up, defs, trainers, 0) is True


def _facts(tree: ast.Module) -> tuple[dict[ast.AST, ast.AST], dict[str, ast.AST], set[str]]:
    """The parents, functions and training functions of the script, computed once per (shared, unchanged)
    tree: recomputed for each DataLoader call, a script with 300 of them took 6 s in this check, 1000 over 60 s."""
    facts = tree.__dict__.get("_tg_passfacts")
    if facts is None:
        defs = {n.name: n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        facts = tree._tg_passfacts = (_parents(tree), defs, _trainers(tree))  # type: ignore[attr-defined]
    return facts
