"""The doctor's "restore in loop" check (``doctor.check`` and ``doctor_source.check_source`` call it,
through ``doctor_source.restore_order``, on the script's source): a restore (``mgr.restore(state)``,
``tg.load(...)``, accelerate's ``accelerator.load_state(...)``, or a function of the script that
calls one) that runs on every pass of a training loop puts the last checkpoint back each time, so
every step since that checkpoint is thrown away (seen: 20 SGD steps with a save every 5 left the
weights of 9), and a resume that happens only after the loop's first steps trained from the
initial weights.

A loop is a training loop when it, or a loop inside it, calls ``backward()``, an optimizer's
``step()`` or a save. Not reported: a restore under an ``if`` or in an ``except`` of the loop
(a rollback after a NaN loss, a resume on the first pass), a loop that ends after one pass
through its body (a ``break`` or ``return`` at its own level: a retry loop, ``while True: try:
mgr.restore(state); train(); break``), and a restore into a state or through a manager made in
the same pass (one run per pass: ``for seed in seeds: with CheckpointManager(f"run-{seed}") as
mgr: mgr.restore(state)``, or ``tg.load(path, {"model": fresh})``).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _is_checkpoint_restore(c: ast.Call) -> bool:
    """A restore of a checkpoint: not an EMA's ``ema.restore(model.parameters())`` (torch_ema swaps
    the live weights back after an evaluation, inside the loop by design)."""
    from .doctor_rng import _is_restore
    from .doctor_source import _receiver

    who = (_receiver(c) or "").lower()
    params = any(isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and "param" in a.func.attr
                 for a in [*c.args, *(k.value for k in c.keywords)])
    return _is_restore(c) and not ("ema" in who or "average" in who or "swa" in who or params)


def _level(loop: ast.AST) -> list[ast.AST]:
    """The statements a loop runs on every pass: its body, and the bodies of the ``with``/``try``
    (not ``if``, ``except``, nested loops or functions) inside it, recursively."""
    out: list[ast.AST] = []
    todo = list(loop.body)  # type: ignore[attr-defined]
    while todo:
        stmt = todo.pop(0)
        out.append(stmt)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            todo += stmt.body
        elif isinstance(stmt, ast.Try):
            todo += [*stmt.body, *stmt.orelse, *stmt.finalbody]
    return out


def _bound(loop: ast.AST) -> set[str]:
    """The names a loop binds on each pass (its target, assignments, ``with ... as``)."""
    return {x.id for x in ast.walk(loop) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}


def _fresh(c: ast.Call, bound: set[str]) -> bool:
    """Whether the restore ``c`` loads into a state, or through a manager, made in this pass."""
    from .doctor_source import _callee, _receiver

    if _receiver(c) in bound:
        return True
    at = 1 if _callee(c) == "load" else 0
    state = c.args[at] if len(c.args) > at else next((k.value for k in c.keywords if k.arg == "state"), None)
    args = [state] if _callee(c) in ("restore", "load") else [*c.args, *(k.value for k in c.keywords)]
    return any(isinstance(a, (ast.Dict, ast.Call)) or isinstance(a, ast.Name) and a.id in bound for a in args)


def _trains(loop: ast.AST, savers: set[str]) -> bool:
    from .doctor_accum import _is_save, _is_step
    from .doctor_source import _callee

    return any(isinstance(c, ast.Call) and (_callee(c) == "backward" or _is_step(c) or _is_save(c)
                                            or _callee(c) in savers) for c in ast.walk(loop))


def _savers(tree: ast.Module) -> set[str]:
    """The script's own functions that save (``save_checkpoint(step)`` calling ``mgr.save``)."""
    from .doctor_accum import _is_save

    return {f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(_is_save(c) for c in ast.walk(f))}


def restore_in_loop(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for a restore on every pass of a training loop (module doc); ``None`` without source
    or without a restore, else ``ok``. Static: any rank, no I/O."""
    from .doctor import Finding
    from .doctor_rng import _helpers
    from .doctor_source import _callee, _receiver, _tree

    if (tree := _tree(s)) is None:
        return None
    _, restorers = _helpers(tree)
    savers = _savers(tree)

    def restores(c: ast.AST) -> bool:
        return isinstance(c, ast.Call) and (_is_checkpoint_restore(c) or _callee(c) in restorers
                                            and _receiver(c) in (None, "self", "cls"))

    if not any(restores(c) for c in ast.walk(tree)):
        return None
    hits: list[tuple[ast.Call, ast.AST]] = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, _LOOPS)):
        level = _level(loop)
        if any(isinstance(x, (ast.Break, ast.Return)) for x in level) or not _trains(loop, savers - restorers):
            continue
        for stmt in level:
            if isinstance(stmt, (ast.If, *_LOOPS, *_SCOPES, ast.With, ast.AsyncWith, ast.Try)):
                continue  # an if's test and a with's items run every pass too, but a restore there is rare
            hits += [(c, loop) for c in ast.walk(stmt) if restores(c) and not _fresh(c, _bound(loop))]
    if not hits:
        return Finding("restore in loop", "ok", "the restore runs once, before the training loop")
    c, loop = min(hits, key=lambda h: h[0].lineno)
    return Finding("restore in loop", "warning", f"line {c.lineno}: {ast.unparse(c)} runs on every pass of the "
                   f"training loop (line {loop.lineno}): each pass puts the last checkpoint back, throwing away "
                   "every step trained since it was saved (and a resume comes only after the first steps trained "
                   "from the initial weights)", "restore once, before the loop: start = mgr.restore(state), then "
                   "loop from start + 1")
