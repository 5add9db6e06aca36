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


def uncovered(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """An error naming the first module of the state no saved optimizer covers, or None."""
    import torch

    opts = [x for _, x in leaves if _is_optimizer(x)]
    try:
        tree = ast.parse(s.source or "")
    except SyntaxError:
        return None
    built = list(_calls(None, _optimizer_names(), tree))
    up = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
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
