"""The doctor's "ema" check (``doctor.check`` and ``doctor_source.check_source`` call it, through
``doctor_source.ema``, on the script's source): a weight average of the script (torch's
``AveragedModel``, torch_ema's ``ExponentialMovingAverage``, timm's ``ModelEma*``, ema_pytorch's
``EMA``, diffusers' ``EMAModel``) updated in a training loop but not in the state. A restarted
process builds it again from the weights it restored, so the average of the steps before the
restart is lost, silently (seen: an ``AveragedModel`` EMA left out of the state, resumed after a
SIGKILL, ended with other weights than the uninterrupted run's, every other tensor equal).

With the state (a ``trainguard_state()`` hook) an average is saved when an object of its class is in
the state, or a key named like it (``{"ema": ema.module}``: timm's and torch's averaged module);
from the source alone, when its name is a value of a dict, of ``state[...] = ``, or an argument
of a call that builds the state (``tg.StateDict(ema=ema)``, ``state.update(ema=ema)``)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_MAKERS = {"AveragedModel", "ExponentialMovingAverage", "ModelEma", "ModelEmaV2", "ModelEmaV3", "EMA", "EMAModel"}
_UPDATES = {"update_parameters", "update", "step"}


def _used_as_value(tree: ast.Module, name: str) -> bool:
    """``name`` (or ``self.name``) put into a dict, a subscript or a call's argument list that is no update of it;
    into a dict or a subscript, also what it holds (``{"ema": ema.state_dict()}``, ``state["ema"] = model_ema.module``:
    reported as not saved before)."""
    def hit(v: ast.AST | None) -> bool:
        return v is not None and (isinstance(v, ast.Name) and v.id == name or isinstance(v, ast.Attribute) and v.attr == name)

    def part(v: ast.AST | None) -> bool:  # ``ema``, or what it holds: ``ema.state_dict()``, timm's ``model_ema.module``
        while not hit(v) and isinstance(v, (ast.Attribute, ast.Call)):
            v = v.func if isinstance(v, ast.Call) else v.value
        return hit(v)

    for n in walk(tree):
        if isinstance(n, ast.Dict) and any(part(v) for v in n.values):
            return True
        if isinstance(n, ast.Assign) and part(n.value) and any(isinstance(t, ast.Subscript) for t in n.targets):
            return True
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Attribute) and hit(n.func.value)) \
                and any(hit(a) for a in [*n.args, *(k.value for k in n.keywords)]):
            return True
    return False


def _named(leaves: list[tuple[str, Any]], name: str) -> bool:
    """A key of the state named like the average (its variable's name, or a word ``ema``, ``swa``,
    ``averaged`` of it): what a hook returns as ``{"ema": ema.module}`` or ``{"model_ema": ema.state_dict()}``,
    where the average's own class is not in the state. Only a key holding weights (a module, a tensor,
    a mapping of them): ``ema_decay=0.999``, ``swa_start=10`` or ``average_loss`` in the state made
    the check say the average was saved (c64c550)."""
    import torch

    def weights(x: Any) -> bool:  # a module, a tensor, or a state_dict of tensors: not ``ema_decay=0.999``
        if isinstance(x, Mapping):
            return any(isinstance(v, (torch.nn.Module, torch.Tensor)) or isinstance(v, Mapping) and weights(v)
                       for v in x.values())
        return isinstance(x, (torch.nn.Module, torch.Tensor))

    words = {"ema", "swa", "averaged", "average"}
    for p, x in leaves:
        key = p.rsplit("/", 1)[-1].lower()
        if (key == name.lower() or words & set(key.split("_"))) and weights(x):
            return True
    return False


def unsaved_ema(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for a weight average updated in a training loop and not saved (module doc); ``ok``
    when saved; ``None`` without source or without such an average. Static, plus the state's classes."""
    from .doctor import Finding
    from .doctor_gens import _ref
    from .doctor_restore import _savers, _trains
    from .doctor_source import _callee, _tree

    if (tree := _tree(s)) is None:
        return None
    made: dict[str, tuple[str, int]] = {}
    for n in walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and (kind := _callee(n.value)) in _MAKERS:
            for t in n.targets:
                if (name := _ref(t)) is not None:
                    made.setdefault(name, (kind, n.lineno))
    if not made:
        return None
    savers = _savers(tree)
    loops = [n for n in walk(tree) if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and _trains(n, savers)]
    defs = {f.name: f for f in walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called = {_callee(c) for lp in loops for c in ast.walk(lp) if isinstance(c, ast.Call)}
    updated: dict[str, ast.Call] = {}
    for scope in loops + [f for name, f in defs.items() if name in called]:
        for c in ast.walk(scope):
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _UPDATES \
                    and (name := _ref(c.func.value)) in made:
                updated.setdefault(name, c)
    if not updated:
        return None
    classes = {k.__name__ for _, x in leaves for k in type(x).__mro__}
    unsaved = [n for n in updated
               if not (made[n][0] in classes or _named(leaves, n) if leaves else _used_as_value(tree, n))]
    if not unsaved:
        return Finding("ema", "ok", f"the weight average is saved ({', '.join(sorted(updated))})")
    name = unsaved[0]
    kind, line = made[name]
    return Finding("ema", "warning", f"{kind} `{name}` (line {line}) is updated at each step (line "
                   f"{updated[name].lineno}: {ast.unparse(updated[name])[:80]}) but is not in the state: a restarted "
                   "process builds it again from the restored weights, so the average of every step before the "
                   "restart is lost", f'add state["{name}"] = {name}')
