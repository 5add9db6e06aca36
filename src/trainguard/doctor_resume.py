"""The doctor's "resume start" check (``doctor_source.source_checks`` runs it on the script's source):
a restore whose result, the step it restored, never reaches the training loop that follows it.

``mgr.restore(state)`` puts the weights, the optimizer and the counters of the state back, but the
loop's own counter is the script's: ``mgr.restore(state)`` then ``for step in range(0, N):`` trains
from step 0 again on the restored weights after each resume, and the manager refuses the first save
behind the restored step (``CheckpointError``), after that work is done and lost (seen: resumed at
step 50, the loop trained steps 0-25 again and ``save(step=25)`` raised).

Read per function (and the module), for each training loop (one that saves) that follows a restore
(``mgr.restore(...)``, ``tg.load(path, state)``, ``accelerator.load_state(...)``, or a function of the
script that calls one) in it. What "reaches" the loop is followed through assignments: the restore's
result (``start = mgr.restore(state)``, ``step = mgr.restore(state) or 0``,
``if (r := mgr.restore(state)) is not None:``), what the restore was given (the state, names of
objects put in it: ``progress["step"]``, ``train_state.step``, ``self.step`` of a trainer saved as
``{"train_state": self}``, a sampler's ``sampler.epoch``), and the manager's ``last_saved_step``.
The loop is resumed when such a value is in its header (``range(start + 1, N)``, ``while
progress["step"] < N``, a loader built from the state), in an ``if`` of it that skips (``if step <
resume_step: continue``), or in the step it gives ``mgr.save``. It is reported (an error) only
when, besides, it visibly starts over: a ``range``/``count`` from a literal (or a name assigned
only literals), a ``while`` on such a counter that the loop increments (or an attribute of an object
built in the function, ``TrainState()``), or a save step that is such a counter. A start the text
does not show (a parameter, ``args.start``, a function's result) is not reported.

Also an error: a loop that resumes at the restored step + 1 (``range(0 if start is None else start +
1, N)``, a counter assigned ``start + 1``) but saves each step before training it (``mgr.save(step,
state)`` above ``loss.backward()``/``optimizer.step()``, nanoGPT's order): the checkpoint of step s
holds the state before step s, and the resume never trains step s (seen: resumed, the run's last
checkpoint differed from the uninterrupted run's in every tensor).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_WRAPS = {"enumerate", "tqdm", "iter", "zip", "list", "islice", "trange"}
_COUNTS = {"range", "trange", "count"}


def _chain(n: ast.AST) -> str | None:
    """``a`` for a name, ``a.b.c`` for an attribute chain on a name, else None."""
    if isinstance(n, ast.Name):
        return n.id
    if isinstance(n, ast.Attribute):
        base = _chain(n.value)
        return None if base is None else f"{base}.{n.attr}"
    return None


def _chains(node: ast.AST | None) -> set[str]:
    """Every name and attribute chain read in ``node`` (``a.b.c`` gives ``a.b.c``, ``a.b`` and ``a``)."""
    return {c for x in ast.walk(node) if (c := _chain(x)) is not None} if node is not None else set()


def _targets(t: ast.AST) -> Iterator[ast.AST]:
    if isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _targets(e)
    elif isinstance(t, ast.Starred):
        yield from _targets(t.value)
    else:
        yield t


def _pairs(n: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """(target, value) of an assignment, tuples paired item by item (``a, b = x, Y()``); None: unpacked from one value."""
    if not isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) or n.value is None:
        return
    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
        todo: list[tuple[ast.AST, ast.AST | None]] = [(t, n.value)]
        while todo:
            t, v = todo.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                same = isinstance(v, (ast.Tuple, ast.List)) and len(v.elts) == len(t.elts) and not any(
                    isinstance(e, ast.Starred) for e in [*t.elts, *v.elts])
                todo += [(e, v.elts[i] if same else None) for i, e in enumerate(t.elts)]  # type: ignore[union-attr]
            elif isinstance(t, ast.Starred):
                todo.append((t.value, None))
            else:
                yield t, v


class _Taint:
    """What in one scope carries restored information (module doc): the names that the restore's result,
    what it was given and ``mgr.last_saved_step`` flow into through assignments (a worklist over the
    scope's assignments, each read once)."""

    def __init__(self, nodes: list[ast.AST], restores: list[ast.Call]) -> None:
        self.calls = {id(r) for r in restores}
        self.first = min(r.lineno for r in restores)
        self.names: set[str] = set()
        for r in restores:  # what it was given: the state (a dict's objects: restore({"progress": progress})), a path
            for a in [*r.args, *(k.value for k in r.keywords)]:
                self.names |= _objects(a)
            if isinstance(r.func, ast.Attribute) and (who := _chain(r.func.value)) is not None:
                self.names |= {f"{who}.last_saved_step", f"{who}.latest_step"}
        edges = [e for n in nodes for e in self._edges(n)]
        readers: dict[str, list[int]] = {}
        for i, (reads, _, _) in enumerate(edges):
            for c in reads:
                readers.setdefault(c, []).append(i)
        todo = [i for i, (reads, hit, _) in enumerate(edges) if hit or reads & self.names]
        while todo:
            for c in edges[todo.pop()][2] - self.names:
                self.names.add(c)
                todo += readers.get(c, [])

    def __call__(self, node: ast.AST | None) -> bool:
        return node is not None and (bool(_chains(node) & self.names) or any(id(x) in self.calls for x in ast.walk(node)))

    def _edges(self, n: ast.AST) -> list[tuple[set[str], bool, set[str]]]:
        """(what it reads, whether it holds the restore's call, what it then carries) for each flow of ``n``."""
        from .doctor_source import _callee

        def hit(x: ast.AST) -> bool:
            return any(id(y) in self.calls for y in ast.walk(x))
        out = []
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and n.value is not None:
            for t, v in _pairs(n):
                value = n.value if v is None else v
                out.append((_chains(value), hit(value), {c for c in [_chain(t)] if c}))
                if n.lineno < self.first and v is not None:  # before the restore, state = {"progress": progress}
                    out.append((_chains(t), False, _objects(v)))  # restored in place
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            out.append((_chains(n.iter), hit(n.iter), {c for x in _targets(n.target) if (c := _chain(x))}))
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            out.append((_chains(n.context_expr), hit(n.context_expr),
                        {c for x in _targets(n.optional_vars) if (c := _chain(x))}))
        elif isinstance(n, ast.Call) and _callee(n) in ("update", "setdefault") and isinstance(n.func, ast.Attribute) \
                and n.lineno < self.first:
            out.append((_chains(n.func.value), False, {c for a in [*n.args, *(k.value for k in n.keywords)]
                                                        for c in _objects(a)}))
        return out


def _objects(value: ast.AST) -> set[str]:
    """The objects a value put into the state names: ``progress`` of ``{"progress": progress}``."""
    if isinstance(value, ast.Dict):
        parts: list[ast.AST] = list(value.values)
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
        parts = [k.value for k in value.keywords]
    else:
        parts = [value]
    return {c for v in parts if (c := _chain(v))}


def _fresh(value: ast.AST | None) -> bool:
    """A value that is the same at every start: a literal, or a class built from literals (``TrainState()``)."""
    if value is None:
        return True
    if isinstance(value, ast.Constant):
        return isinstance(value.value, (int, float)) and not isinstance(value.value, bool)
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub):
        return _fresh(value.operand)
    if isinstance(value, ast.Call):
        from .doctor_source import _callee

        name = _callee(value)
        return (name[:1].isupper() or name == "dict") and all(_fresh(a) for a in [*value.args, *(k.value for k in value.keywords)])
    return False


def _assigned(nodes: list[ast.AST], chain: str, before: int) -> list[ast.AST | None]:
    """The values assigned to ``chain`` in the scope's statements before line ``before`` (None: not a plain value)."""
    return [v for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.lineno < before
            for t, v in _pairs(n) if _chain(t) == chain]


def _counter(nodes: list[ast.AST], loop: ast.AST, chain: str) -> ast.AST | None:
    """The literal that ``chain`` is set to before ``loop`` (``step = 0``, or ``TrainState()`` for
    ``ts.step`` of ``ts = TrainState()``) when the loop moves it (``step += 1``), else None."""
    if not any(isinstance(x, ast.AugAssign) and _chain(x.target) == chain for x in ast.walk(loop)):
        return None
    for c in [chain, chain.rsplit(".", 1)[0]] if "." in chain else [chain]:
        values = _assigned(nodes, c, loop.lineno)  # type: ignore[attr-defined]
        if values:
            return values[-1] if all(_fresh(v) for v in values) else None
    return None


def _header(loop: ast.AST, nodes: list[ast.AST]) -> str | None:
    """The start that the loop's header shows to be always the same (``range(N)``), or None."""
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        from .doctor_source import _callee

        it = loop.iter
        while isinstance(it, ast.Call) and _callee(it) in _WRAPS - {"trange"} and it.args:
            it = it.args[0]
        if not (isinstance(it, ast.Call) and _callee(it) in _COUNTS):
            return None
        start = it.args[0] if len(it.args) >= (1 if _callee(it) == "count" else 2) else None
        if _fresh(start) or isinstance(start, ast.Name) and (vs := _assigned(nodes, start.id, loop.lineno)) and all(
                _fresh(v) for v in vs):
            from .doctor_datapos import _target

            return f"for {_target(loop.target)} in {ast.unparse(loop.iter)}"
        return None
    if isinstance(loop, ast.While):
        for c in sorted(_chains(loop.test)):
            if (v := _counter(nodes, loop, c)) is not None:
                return f"while {ast.unparse(loop.test)} ({c} from {ast.unparse(v)})"
    return None


def _saves(loop: ast.AST, managers: set[str], savers: set[str]) -> tuple[bool, list[ast.AST], list[ast.AST], bool]:
    """Whether the loop saves; what its saves are given (the step of a ``save(step, ...)``, every
    argument of a function of the script that saves); the steps given to the restoring managers;
    whether it saves through another manager too."""
    from .doctor_accum import _is_save
    from .doctor_source import _callee

    calls = [c for c in ast.walk(loop) if isinstance(c, ast.Call)]
    mine = [c for c in calls if _callee(c) in savers]
    given: list[ast.AST] = [a for c in mine for a in [*c.args, *(k.value for k in c.keywords)]]
    steps = [(c, c.args[0] if c.args else next((k.value for k in c.keywords if k.arg == "step"), None)) for c in calls
             if _is_save(c) and _callee(c) in ("save", "async_save") and c not in mine]
    given += [x for _, x in steps if x is not None]
    own = [c for c, _ in steps if isinstance(c.func, ast.Attribute) and _chain(c.func.value) in managers]
    return (bool(mine) or any(_is_save(c) for c in calls), given, [x for c, x in steps if c in own and x is not None],
            len(own) < len(steps))


def _skips(loop: ast.AST, taint: _Taint) -> bool:
    """An ``if`` on restored information that skips a pass: ``if step < resume_step: continue``."""
    return any(isinstance(x, ast.If) and taint(x.test) and any(isinstance(y, ast.Continue) for y in ast.walk(x))
               for x in ast.walk(loop))


def _restarted_step(step: ast.AST, loop: ast.AST, nodes: list[ast.AST]) -> bool:
    """A save step that starts over: a counter set to a literal before the loop, or a loop's own index
    over a ``range`` from a literal."""
    c = _chain(step)
    if c is None:
        return False
    if _counter(nodes, loop, c) is not None:
        return True
    return any(isinstance(x, (ast.For, ast.AsyncFor)) and _chain(x.target) == c and _header(x, nodes) is not None
               for x in ast.walk(loop))


def _plus_one(expr: ast.AST | None, nodes: list[ast.AST], before: int, taint: _Taint) -> bool:
    """Whether a loop's start is the restored step plus one (``start + 1``, ``0 if start is None else
    start + 1``), in the expression or in what its name is assigned before the loop."""
    if expr is None:
        return False
    values = [expr, *(v for v in _assigned(nodes, expr.id, before) if v is not None)] if isinstance(expr, ast.Name) else [expr]
    return any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Add) and isinstance(b.right, ast.Constant)
               and b.right.value == 1 and taint(b.left) for v in values for b in ast.walk(v))


def _saved_before_trained(loop: ast.AST, nodes: list[ast.AST], managers: set[str], taint: _Taint) -> str | None:
    """A loop that resumes at the restored step + 1 but saves each step before training it
    (``mgr.save(step, state)`` above ``loss.backward()``): the checkpoint of step s holds the state
    before step s trained, so a resume never trains step s."""
    from .doctor_accum import _is_step
    from .doctor_source import _callee

    if isinstance(loop, (ast.For, ast.AsyncFor)):
        it = loop.iter
        while isinstance(it, ast.Call) and _callee(it) in _WRAPS - {"trange"} and it.args:
            it = it.args[0]
        if not (isinstance(it, ast.Call) and _callee(it) in _COUNTS and it.args):
            return None
        counter, start = _chain(loop.target), it.args[0] if len(it.args) >= (1 if _callee(it) == "count" else 2) else None
    elif isinstance(loop, ast.While):
        moved = [x for x in ast.walk(loop) if isinstance(x, ast.AugAssign) and _chain(x.target) in _chains(loop.test)]
        counter = _chain(moved[0].target) if moved else None
        start = ast.Name(id=counter, ctx=ast.Load()) if counter and "." not in counter else None
    else:
        return None
    if counter is None or not _plus_one(start, nodes, loop.lineno, taint):  # type: ignore[attr-defined]
        return None
    calls = [c for c in ast.walk(loop) if isinstance(c, ast.Call)]
    saves = [c for c in calls if _callee(c) == "save" and isinstance(c.func, ast.Attribute) and _chain(c.func.value)
             in managers and (c.args[:1] or [None])[0] is not None and _chain(c.args[0]) == counter]
    trains = [c for c in calls if _callee(c) == "backward" or _is_step(c)]
    if saves and trains and min(c.lineno for c in saves) < min(c.lineno for c in trains):
        first = min(saves, key=lambda c: c.lineno)
        train = min(trains, key=lambda c: c.lineno)
        return (f"saves each step before training it (line {first.lineno}: {ast.unparse(first)}, before line "
                f"{train.lineno}: {ast.unparse(train)}) and resumes at the restored step + 1")
    return None


def resume_start(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """An error for a training loop that starts over after a restore (module doc); ``None`` without
    source or without a restore, else ``ok``. Static: any rank, no I/O."""
    from .doctor import Finding
    from .doctor_restore import _is_checkpoint_restore, _savers
    from .doctor_rng import _helpers
    from .doctor_source import _callee, _own_nodes, _receiver, _tree

    if (tree := _tree(s)) is None:
        return None
    _, restorers = _helpers(tree)
    savers = _savers(tree) - restorers
    hits: list[tuple[ast.AST, ast.Call, str]] = []
    seen = False
    asserted = {id(x) for n in walk(tree) if isinstance(n, ast.Assert) for x in ast.walk(n)}
    for scope in [tree, *(n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        nodes = list(_own_nodes(scope))
        restores = [c for c in nodes if isinstance(c, ast.Call) and (_is_checkpoint_restore(c) and not (
            _callee(c) == "load" and len(c.args) > 1 and isinstance(c.args[1], ast.Dict))  # tg.load(p, {...}): a warm start
            or _callee(c) in restorers and _receiver(c) in (None, "self", "cls"))]
        if not restores:
            continue
        seen = True
        if any(id(r) in asserted or any(k.arg == "step" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                                        for k in r.keywords) for r in restores):
            continue  # assert mgr.restore(state) is None, a rollback to a step it names: the script knows the start
        taint = _Taint(nodes, restores)
        guarded = {id(x) for n in nodes if isinstance(n, ast.If) and taint(n.test) for x in ast.walk(n)}  # if start is None:
        managers = {w for r in restores if isinstance(r.func, ast.Attribute) and (w := _chain(r.func.value))}
        first = min(r.lineno for r in restores)
        loops = [n for n in nodes if isinstance(n, _LOOPS) and n.lineno > first]
        inner = {id(x) for n in loops for x in ast.walk(n) if x is not n}
        for loop in (n for n in loops if id(n) not in inner and id(n) not in guarded):
            saves, given, steps, others = _saves(loop, managers, savers)
            if not saves or _skips(loop, taint) or any(taint(x) for x in given) or managers and others and not steps:
                continue  # others only: saves through another manager than the one restored (a warm start)
            head = loop.iter if isinstance(loop, (ast.For, ast.AsyncFor)) else loop.test  # type: ignore[attr-defined]
            why = None if taint(head) or (h := _header(loop, nodes)) is None else f"starts at the same step on every run: {h}"
            if why is None and (late := [x for x in steps if _restarted_step(x, loop, nodes)]):  # save(1) after step 50
                why = f"gives the manager a step that starts over on every run: save({ast.unparse(late[0])}, ...)"
            if why is not None:
                hits.append((loop, min(restores, key=lambda r: r.lineno), why))
        for loop in (n for n in loops if id(n) not in guarded):  # (inner loops too: the step loop of an epoch loop)
            if (why := _saved_before_trained(loop, nodes, managers, taint)) is not None:
                hits.append((loop, min(restores, key=lambda r: r.lineno), why))
    if not seen:
        return None
    if not hits:
        return Finding("resume start", "ok", "the training loop starts from what the restore returned or restored")
    loop, r, why = min(hits, key=lambda h: h[0].lineno)  # type: ignore[attr-defined]
    if why.startswith("saves each step before"):
        return Finding("resume start", "error", f"line {loop.lineno}: the training loop {why} "  # type: ignore[attr-defined]
                       f"that {ast.unparse(r)} (line {r.lineno}) returns: the checkpoint of step s holds the state "
                       "before step s trained, so a resume from it goes on at s + 1 and step s is never trained "
                       "(nor its batch drawn): the run is no longer the uninterrupted one", "save after the "
                       "optimizer step, or resume at the restored step itself: range(0 if start is None else start, N)")
    return Finding("resume start", "error", f"line {loop.lineno}: the training loop {why}, whatever "  # type: ignore[attr-defined]
                   f"{ast.unparse(r)} (line {r.lineno}) restored: neither the step it returns nor a counter of the "
                   "state sets where the loop starts, so a resumed run trains from the first step again on the "
                   "restored weights, and the manager refuses its first save behind the restored step "
                   "(CheckpointError) after that work is done", "start from the restored step: start = "
                   "mgr.restore(state), then for step in range(0 if start is None else start + 1, N) (or loop on a "
                   "counter kept in the state: while progress[\"step\"] < N)")
