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
import sys
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk
from .doctor_torchfree import class_names

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _is_checkpoint_restore(c: ast.Call) -> bool:
    """A restore of a checkpoint: not an EMA's ``ema.restore(model.parameters())`` (torch_ema swaps
    the live weights back after an evaluation, inside the loop by design)."""
    from .doctor_rng import _is_restore
    from .doctor_source import _callee, _receiver

    who = (_receiver(c) or "").lower()
    params = any(isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and "param" in a.func.attr
                 for a in [*c.args, *(k.value for k in c.keywords)])
    bare = _callee(c) == "restore" and not (c.args or c.keywords)  # mgr.restore needs a state: a timer's, a context's
    return _is_restore(c) and not ("ema" in who or "average" in who or "swa" in who or params or bare)


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

    return {f.name for f in walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
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

    if not any(restores(c) for c in walk(tree)):
        return None
    hits: list[tuple[ast.Call, ast.AST]] = []
    for loop in (n for n in walk(tree) if isinstance(n, _LOOPS)):
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


_SCHEDULE_MAKERS = {"get_scheduler", "get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup",
                    "get_constant_schedule_with_warmup", "get_polynomial_decay_schedule_with_warmup"}  # transformers
_FILE_LOADS = {"load", "load_file", "load_state_dict_from_url"}  # torch.load, safetensors, torch.hub


def _made(c: ast.Call, optimizers: set[str]) -> str | None:
    """``optimizer``/``LR scheduler`` when ``c`` builds one (``torch.optim.AdamW(...)``,
    ``lr_scheduler.StepLR(...)``, transformers' ``get_scheduler(...)``), else ``None``."""
    from .doctor_source import _callee, _receiver

    name = _callee(c)
    if name in optimizers:
        return "optimizer"
    if name in _SCHEDULE_MAKERS or _receiver(c) == "lr_scheduler" and name[:1].isupper() or name in _schedulers():
        return "LR scheduler"
    return None


_FACTORIES = {"from_pretrained", "create_model", "build_model", "get_model", "make_model", "from_config"}  # timm, HF


def _rebuilt(c: ast.Call, nodes: list[ast.AST]) -> bool:
    """``after_restore``: whether ``c`` builds a new object into a name (``model = Net(cfg)``,
    ``model = AutoModel.from_pretrained(...)``) rather than wrapping or moving the one it had
    (``model = DDP(model)``, ``torch.compile(model)``, ``model.to(device)``): a class (a capitalised
    callee) or a model factory, called with nothing of the assigned names' own. Whether that name
    is in the restored state is ``_into_state``'s to say."""
    from .doctor_source import _callee

    name = _callee(c)
    if not (name[:1].isupper() or name in _FACTORIES):
        return False
    targets = {t.id for n in nodes if isinstance(n, ast.Assign) and n.value is c for t in n.targets
               if isinstance(t, ast.Name)}
    return bool(targets) and not any(isinstance(v, ast.Name) and v.id in targets for v in ast.walk(c))


def _schedulers() -> set[str]:
    """torch's LR scheduler classes, for ``from torch.optim.lr_scheduler import OneCycleLR``; read from its
    source where torch is not imported (``doctor_torchfree``: ``trainguard doctor`` on a script's source)."""
    if "torch" not in sys.modules and (names := class_names("optim/lr_scheduler.py", "LRScheduler")) is not None:
        return set(names)
    import torch

    base = getattr(torch.optim.lr_scheduler, "LRScheduler", torch.optim.lr_scheduler._LRScheduler)
    return {n for n, c in vars(torch.optim.lr_scheduler).items() if isinstance(c, type) and issubclass(c, base)
            and c is not base and not n.startswith("_")}


def _from_file(arg: ast.AST | None, files: set[str]) -> bool:
    """Whether a ``load_state_dict`` argument comes from a file: ``torch.load(...)``, a name assigned one,
    or an item of it (``ckpt["model"]``)."""
    from .doctor_source import _callee

    while isinstance(arg, ast.Subscript):
        arg = arg.value
    return isinstance(arg, ast.Call) and _callee(arg) in _FILE_LOADS or isinstance(arg, ast.Name) and arg.id in files


def _into_state(made: ast.Call, loads: list[ast.Call], nodes: list[ast.AST]) -> bool:
    """Whether what ``made`` builds goes into a restored state (``state["optim"] = opt``, a dict
    assigned to the state's name, ``state.update(...)``; for ``accelerator.load_state``, its
    ``prepare(...)``/``register_for_checkpointing(...)``): one kept out of it is the optimizer+scheduler
    check's finding, not this one."""
    from .doctor_source import _callee, _receiver

    states, accel = set(), False
    for c in loads:
        at = 1 if _callee(c) == "load" else 0
        arg = c.args[at] if len(c.args) > at else next((k.value for k in c.keywords if k.arg == "state"), None)
        states |= {arg.id} if isinstance(arg, ast.Name) else set()
        accel = accel or _callee(c) == "load_state"

    def stored(t: ast.AST) -> bool:
        return isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in states
    name = None
    for n in nodes:
        if isinstance(n, ast.Assign) and n.value is made:
            if any(stored(t) for t in n.targets):
                return True
            name = next((t.id for t in n.targets if isinstance(t, ast.Name)), None)
    if name is None:
        return False

    def uses(x: ast.AST) -> bool:
        return any(isinstance(v, ast.Name) and v.id == name for v in ast.walk(x))
    for n in nodes:
        if isinstance(n, ast.Assign) and uses(n.value) and any(
                stored(t) or isinstance(t, ast.Name) and t.id in states for t in n.targets):
            return True
        if isinstance(n, ast.Call) and uses(n) and (_callee(n) == "update" and _receiver(n) in states or accel and _callee(
                n) in ("prepare", "register_for_checkpointing")):
            return True
    return False


def after_restore(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for what, after ``mgr.restore(state)``/``accelerator.load_state(...)`` in the same
    function, undoes it or escapes it: an optimizer or LR scheduler built after it (the restore could
    not load into an object that did not exist: Adam's moments and the schedule restart on each
    resume, or strict restores fail there), or a ``load_state_dict(torch.load(...))`` that overwrites
    what it restored (pretrained weights loaded after the restore reset a fine-tune on each resume).
    An optimizer or scheduler never put in the state is not reported here (the optimizer+scheduler
    check's). Not reported on a fresh start only (``if start is None:``), nor when another restore follows
    before any loop; ``tg.load(path, {...})`` of a literal dict (a warm start) restores no optimizer.
    ``None`` without source or without a restore. Static: any rank, no I/O."""
    from .doctor import Finding, _optimizer_names
    from .doctor_rng import _fresh_branch, _put_back
    from .doctor_source import _callee, _own_nodes, _tree

    if (tree := _tree(s)) is None:
        return None
    optimizers, restored, hits = _optimizer_names(), False, []
    for scope in [tree, *(n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        nodes = list(_own_nodes(scope))
        loads = [c for c in nodes if isinstance(c, ast.Call) and _is_checkpoint_restore(c)]
        if not loads:
            continue
        restored = True
        whole = [c for c in loads if not (_callee(c) == "load" and len(c.args) > 1 and isinstance(c.args[1], ast.Dict))]
        loops = [n for n in nodes if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
        looped = {id(x) for n in loops for x in ast.walk(n)}
        results = {t.id for n in nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and n.value in loads for t in n.targets if isinstance(t, ast.Name)}
        fresh = {id(x) for n in nodes if isinstance(n, ast.If) for b in _fresh_branch(n, results, loads)
                 for x in ast.walk(b)}
        files = {t.id for n in nodes if isinstance(n, ast.Assign) and _from_file(n.value, set())
                 for t in n.targets if isinstance(t, ast.Name)}
        for c in nodes:
            if not isinstance(c, ast.Call) or id(c) in fresh:
                continue
            after = whole and c.lineno > min(x.lineno for x in whole)
            kind = (_made(c, optimizers) or ("object" if _rebuilt(c, nodes) else None)) if after else None
            kind = kind if kind is None or _into_state(c, whole, nodes) else None
            if kind is None and c.lineno > min(x.lineno for x in loads) and _callee(c) == "load_state_dict" and \
                    _from_file((c.args or [None])[0], files):
                kind = "file's state"
            if kind is not None and not _put_back(c, loads, loops, looped):
                hits.append((c, kind))
    if not restored:
        return None
    if not hits:
        return Finding("after restore", "ok", "nothing built or loaded after the restore undoes it")
    c, kind = min(hits, key=lambda h: h[0].lineno)
    if kind == "object":
        return Finding("after restore", "warning", f"line {c.lineno}: {ast.unparse(c)} after the restore builds a new "
                       "object in place of one the restore loaded (its name is in the restored state): training goes "
                       "on with the new one, from fresh weights (or values) on each resume, while the restored one is "
                       "left unused", "build it before mgr.restore(state) and put that object in the state; wrap it "
                       "after the restore if needed (model = DDP(model), torch.compile(model))")
    if kind == "file's state":
        return Finding("after restore", "warning", f"line {c.lineno}: {ast.unparse(c)} after the restore "
                       "overwrites what it just restored with that file's state on every resume (pretrained "
                       "weights loaded after it restart a fine-tune from them)", "load it before "
                       "mgr.restore(state), or only on a fresh start: if start is None: ...")
    return Finding("after restore", "warning", f"line {c.lineno}: the {kind} ({ast.unparse(c.func)}) is built "
                   "after the restore, which could not load into it: on each resume it starts afresh ("
                   + ("Adam's moments, momentum" if kind == "optimizer" else "warmup and decay") + " from zero), or "
                   "a strict restore fails on its saved entry", f"build the {kind} before mgr.restore(state) and "
                   "put it in the state")
