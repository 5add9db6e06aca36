"""The doctor's "optimizer+scheduler" check: a model of the state that no saved optimizer trains.

A GAN (or any script with one optimizer per model) that puts ``optG`` in the state and leaves
``optD`` out resumes the discriminator's Adam moments from zero; the check saw an optimizer in
the state and said nothing (before). Reported when a module of the state has trainable
parameters of which no optimizer of the state holds any, and the script assigns optimizers
(``torch.optim.Adam(...)``) to more distinct names than the state holds optimizers: one name bound
by both branches of an ``if`` counts once, and an EMA copy (trainable parameters, no optimizer of
its own) is not reported in a script that builds one optimizer.
"""

from __future__ import annotations

import ast
from typing import Any

from .doctor import Finding, Settings, _calls, _is_optimizer, _optimizer_names
from .doctor_parse import parse, walk


def uncovered(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """An error naming the first module of the state no saved optimizer covers, or None."""
    import torch

    opts = [x for _, x in leaves if _is_optimizer(x)]
    if (tree := parse(s.source)) is None:
        return None
    built = list(_calls(None, _optimizer_names(), tree))
    up = {c: p for p in walk(tree) for c in ast.iter_child_nodes(p)}
    names = {ast.unparse(a.targets[0]) for c in built if isinstance(a := up.get(c), ast.Assign) and len(a.targets) == 1}
    if not opts or len(names) <= len(opts):
        return None
    held = {id(q) for o in opts for g in o.param_groups for q in g["params"]}
    for p, x in leaves:
        if isinstance(x, torch.nn.Module):
            trainable = [q for q in x.parameters() if q.requires_grad]
            if trainable and not any(id(q) in held for q in trainable):
                return Finding("optimizer+scheduler", "error", f"no optimizer of the state trains {p} "
                               f"({type(x).__name__}), and the script builds {len(names)} optimizers "
                               f"({', '.join(sorted(names))}) where the state holds {len(opts)}: a resume "
                               "restarts the missing one's moments/momentum from zero",
                               "put every optimizer in the state: state[\"optD\"] = optD")
    return None


def unsaved_scheduler(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """An error when the script builds more LR schedulers that it steps (``sched.step()``, or a function
    of the script stepping the parameter it is handed) than the state holds, and a saved optimizer has
    none: after a resume the schedule starts again from its first step (warmup, decay) under the
    restored weights and moments (seen: a StepLR(step_size=30) left out, resumed at step 50 of 100,
    ended at lr 0.00025 where the uninterrupted run had 0.000125). An ``ExponentialLR`` only multiplies
    the learning rate the optimizer restored, so its run goes on exactly (seen): a warning. A scheduler
    built but never stepped is left to the "saved without an LR scheduler" warning. None otherwise."""
    from .doctor import _is_scheduler
    from .doctor_restore import _made
    from .doctor_resume import _chain
    from .doctor_source import _callee, _receiver

    opts = [(p, x) for p, x in leaves if _is_optimizer(x)]
    scheds = [x for _, x in leaves if _is_scheduler(x)]
    # and those an object of the state holds (a container of the script's own with state_dict: Schedules(opt).s)
    held = [v for _, x in leaves if not _is_scheduler(x) for v in (getattr(x, "__dict__", None) or {}).values()]
    scheds += [v for v in [*held, *(w for v in held if isinstance(v, (list, tuple)) for w in v)] if _is_scheduler(v)]
    bare = [(p, o) for p, o in opts if not any(sc.optimizer is o for sc in scheds)]
    if (tree := parse(s.source)) is None:
        return None
    if not bare:
        return None
    optimizers = _optimizer_names()
    up = {c: p for p in walk(tree) for c in ast.iter_child_nodes(p)}
    built: dict[str, ast.Call] = {}  # name -> the call that builds it
    for c in walk(tree):
        if isinstance(c, ast.Call) and _made(c, optimizers) == "LR scheduler" and isinstance(a := up.get(c), ast.Assign) \
                and len(a.targets) == 1 and (name := _chain(a.targets[0])) is not None:
            built.setdefault(name, c)
    calls = [c for c in walk(tree) if isinstance(c, ast.Call)]
    steppers = {}  # a function of the script -> its parameters that it steps
    for f in walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in [*f.args.posonlyargs, *f.args.args]]
            steps = {_receiver(c) for c in ast.walk(f) if isinstance(c, ast.Call) and _callee(c) == "step"}
            steppers[f.name] = [p for p in params if p in steps]

    def stepped(name: str) -> bool:
        for c in calls:
            if _callee(c) == "step" and isinstance(c.func, ast.Attribute) and _chain(c.func.value) == name:
                return True
            params = steppers.get(_callee(c), [])
            if params and any(_chain(a) == name for a in [*c.args, *(k.value for k in c.keywords)]):
                return True  # handed to train(model, opt, sched), which calls sched.step()
        return False
    live = {n: c for n, c in built.items() if stepped(n)}
    if len(live) <= len(scheds):
        return None
    where = "; ".join(f"{n}, line {c.lineno}: {_callee(c)}" for n, c in live.items())
    what = f"the script builds and steps {len(live)} LR scheduler(s) ({where}) and the state holds {len(scheds)}"
    if all(_callee(c) == "ExponentialLR" for c in live.values()):
        return Finding("optimizer+scheduler", "warning", f"{what}: an ExponentialLR only multiplies the learning rate "
                       "the optimizer restored, so its decay goes on, but its step count (last_epoch) restarts at 0",
                       'add it anyway: state["sched"] = lr_scheduler')
    return Finding("optimizer+scheduler", "error", f"{what}: the optimizer {bare[0][0]} is saved without one, so after "
                   "a resume its schedule starts again from the first step (warmup, decay) under the restored weights "
                   "and moments, and the run is no longer the uninterrupted one", "put every scheduler the loop "
                   'steps in the state: state["sched"] = lr_scheduler')
