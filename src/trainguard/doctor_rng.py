"""The doctor's "rng after restore" check (``doctor.check`` and ``doctor_source.check_source`` call
it, on the script's source): a global seed set after ``mgr.restore``/``tg.load`` (or accelerate's
``accelerator.load_state``) overwrites the RNG state just restored, unless it runs on a fresh start
only (``if start is None:``)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_SEEDERS = {"set_seed", "seed_everything"}  # transformers/accelerate, lightning: every global generator
_SEEDS = {"manual_seed", "manual_seed_all", "seed"}  # of torch, torch.cuda, random, np.random (not a Generator)


def reseed(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A global seed set after ``mgr.restore``/``tg.load`` in the same function overwrites the RNG
    state just restored (``tg.RNGState()``), so a resumed run draws other numbers than an
    uninterrupted one. Seeding inside ``if start is None:`` (a fresh start only) is fine."""
    from .doctor import Finding
    from .doctor_source import _callee, _own_nodes, _receiver, _tree

    if (tree := _tree(s)) is None:
        return None
    if leaves and not any(type(x).__name__ == "RNGState" or "rng" in p.rsplit("/", 1)[-1].lower() for p, x in leaves):
        return None  # no RNG state saved: the rng check says so
    restored, hits = False, []
    seeders, restorers = _helpers(tree)
    for scope in [tree, *(n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        nodes = list(_own_nodes(scope))
        loads = [c for c in nodes if isinstance(c, ast.Call) and (_is_restore(c) or _callee(c) in restorers
                                                                 and _receiver(c) in (None, "self", "cls"))]
        if not loads:
            continue
        restored, first = True, min(c.lineno for c in loads)
        loops = [n for n in nodes if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
        looped = {id(x) for n in loops for x in ast.walk(n)}
        results = {t.id for n in nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and n.value in loads for t in n.targets if isinstance(t, ast.Name)}
        fresh = {id(x) for n in nodes if isinstance(n, ast.If) for b in _fresh_branch(n, results, loads) for x in ast.walk(b)}
        hits += [c for c in nodes if isinstance(c, ast.Call) and c.lineno > first and id(c) not in fresh and (
            _is_seed(c) or _callee(c) in seeders and _receiver(c) in (None, "self", "cls"))
            and not _put_back(c, loads, loops, looped)]
    if not restored:
        return None
    if not hits:
        return Finding("rng after restore", "ok", "no global seed set after the restore")
    c = min(hits, key=lambda c: c.lineno)
    return Finding("rng after restore", "warning", f"line {c.lineno}: {ast.unparse(c)} after the restore: it "
                   "overwrites the RNG state just restored, so a resumed run draws other numbers (data, dropout) "
                   "than an uninterrupted one", "seed before mgr.restore(state), which then puts the saved RNG "
                   "back, or only on a fresh start: if start is None: ...")


def _fresh_branch(n: ast.If, results: set[str], loads: list[ast.Call]) -> list[ast.AST]:
    """``reseed``: what of ``n`` runs on a fresh start only: the body of ``if start is None:`` / ``if not
    start:``, the else of ``if start is not None:`` / ``if start:`` (``start``: a restore's result or
    call), all of it for another test on the result, nothing for a test not on it."""
    def on(v: ast.AST) -> bool:
        return isinstance(v, ast.Name) and v.id in results or any(v is c for c in loads)
    t = n.test
    none = isinstance(t, ast.Compare) and len(t.ops) == 1 and on(t.left) and isinstance(t.comparators[0], ast.Constant) \
        and t.comparators[0].value is None
    if none and isinstance(t.ops[0], (ast.Is, ast.Eq)) or isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and on(t.operand):
        return list(n.body)
    if none and isinstance(t.ops[0], (ast.IsNot, ast.NotEq)) or on(t):
        return list(n.orelse)
    return [n] if any(on(v) for v in ast.walk(t)) else []


def _put_back(c: ast.Call, loads: list[ast.Call], loops: Sequence[ast.stmt], looped: set[int]) -> bool:
    """``reseed``: whether another restore follows the seed ``c`` before any loop starts (and ``c`` is
    in none): examples/fsdp2.py rebuilds its state (seeding) after training, then restores into it."""
    after = [x.lineno for x in loads if x.lineno > c.lineno]
    return id(c) not in looped and bool(after) and not any(c.lineno < n.lineno < min(after) for n in loops)


def _is_seed(c: ast.Call) -> bool:
    from .doctor_source import _callee, _receiver

    return _callee(c) in _SEEDERS or _callee(c) in _SEEDS and _receiver(c) in ("torch", "cuda", "random")


def _is_restore(c: ast.Call) -> bool:
    from .doctor_source import _callee, _receiver

    return _callee(c) == "restore" or _callee(c) == "load" and _receiver(c) in ("tg", "trainguard") or (
        _callee(c) == "load_state" and "accelerator" in (_receiver(c) or "").lower())  # its RNG states too


def _helpers(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``reseed``: the script's own functions and methods that set a global seed (``seed_all(seed)``
    calling ``torch.manual_seed``) and those that restore (``load_checkpoint()`` calling
    ``mgr.restore``), by name; helpers of helpers are followed. One that restores is no seeder:
    its own body is checked as any function is."""
    from .doctor_source import _callee, _own_nodes, _receiver

    funcs = [n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    calls = {id(f): [c for c in _own_nodes(f) if isinstance(c, ast.Call)] for f in funcs}
    seeders: set[str] = set()
    restorers: set[str] = set()
    for _ in range(4):
        before = len(seeders) + len(restorers)
        for f in funcs:
            mine = [c for c in calls[id(f)] if _receiver(c) in (None, "self", "cls") and _callee(c) != f.name]
            if any(_is_restore(c) for c in calls[id(f)]) or any(_callee(c) in restorers for c in mine):
                restorers.add(f.name)
            elif any(_is_seed(c) for c in calls[id(f)]) or any(_callee(c) in seeders for c in mine):
                seeders.add(f.name)
        if len(seeders) + len(restorers) == before:
            break
    return seeders - restorers, restorers
