"""The doctor's "pass seeding" check (``doctor.check`` and ``doctor_source.check_source`` call it, on
the script's source): a DataLoader with persistent workers whose generator the script seeds again
(``val_loader.generator.manual_seed(0)`` before each validation pass, docs/data.md).

Seeding a loader's generator before each pass makes every pass draw the same only when the pass
starts new worker processes: torch seeds a worker once, when it starts, from the base seed it
draws from that generator. Persistent workers (``persistent_workers=True``) started with the first
pass and keep their generators' streams: the seed reaches the sampler's shuffle, not what the
dataset draws in them, so a resumed process's first pass draws what the uninterrupted run's
*first* pass drew (seen: a validation pass after a resume at step 4 of 12, persistent workers
with random augmentation, differed from the uninterrupted run's at every pass, the training
losses equal).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings


def _on(v: ast.AST | None) -> bool:
    """A keyword's value that may be true: anything but a literal false one (``False``, ``0``, ``None``)."""
    return v is not None and not (isinstance(v, ast.Constant) and not v.value)


def _in_loops(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside a ``for`` or ``while`` loop's body."""
    return {id(n) for loop in walk(tree) if isinstance(loop, (ast.For, ast.While))
            for stmt in loop.body for n in ast.walk(stmt)}


def _seeded_names(tree: ast.Module, call: ast.Call, name: str) -> list[ast.Call]:
    """The ``manual_seed``/``seed`` calls of the script on the loader's generator: ``name.generator``
    (also ``self.name.generator``), or the variable passed as ``generator=`` when seeded in a loop
    (``g.manual_seed(seed)`` once, before the loader is built, is the ordinary way to seed it)."""
    gen = next((k.value for k in call.keywords if k.arg == "generator"), None)
    gname = gen.id if isinstance(gen, ast.Name) else None
    looped = _in_loops(tree)
    out = []
    for c in walk(tree):
        if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("manual_seed", "seed")):
            continue
        v = c.func.value
        on_loader = isinstance(v, ast.Attribute) and v.attr == "generator" and (
            isinstance(v.value, ast.Name) and v.value.id == name or isinstance(v.value, ast.Attribute) and v.value.attr == name)
        if on_loader or (gname is not None and isinstance(v, ast.Name) and v.id == gname and id(c) in looped):
            out.append(c)
    return sorted(out, key=lambda c: c.lineno)


def _seeded_dataset(call: ast.Call) -> bool:
    """Whether the loader reads a ``tg.SeededDataset(...)`` built in the call: its draws depend on
    ``(seed, epoch, index)`` only, persistent workers or not."""
    ds = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "dataset"), None)
    return isinstance(ds, ast.Call) and "SeededDataset" in ast.unparse(ds.func)


def pass_seeding(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for a ``DataLoader`` with worker processes and ``persistent_workers`` on whose generator
    the script seeds (module doc); ``None`` without source or without such a loader."""
    from .doctor import Finding
    from .doctor_signals import _workers
    from .doctor_source import _tree

    if (tree := _tree(s)) is None:
        return None
    for n in walk(tree):
        if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.value, ast.Call)):
            continue
        call, t = n.value, n.targets[0]
        f = call.func
        if not ((isinstance(f, ast.Name) and f.id == "DataLoader") or (isinstance(f, ast.Attribute) and f.attr == "DataLoader")):
            continue
        name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
        persistent = next((k.value for k in call.keywords if k.arg == "persistent_workers"), None)
        if name is None or not _on(persistent) or not _workers(call, tree) or _seeded_dataset(call):
            continue
        if seeds := _seeded_names(tree, call, name):
            c = seeds[0]
            return Finding("pass seeding", "warning", f"line {c.lineno}: {ast.unparse(c)} seeds the generator of "
                           f"`{name}` (line {call.lineno}), whose workers persist (persistent_workers="
                           f"{ast.unparse(persistent)}): they were seeded once, when they started, so the seed reaches "
                           "the shuffle order but not what the dataset draws in them; after a resume the first pass "
                           "draws what the uninterrupted run's first pass drew: random augmentation in the dataset then differs "
                           "from the uninterrupted run's (nothing differs where the dataset draws no random numbers)",
                           "persistent_workers=False for a loader seeded at each pass, or wrap its dataset in "
                           "tg.SeededDataset(ds, seed=0) read through tg.ResumableSampler(len(ds), seed=0, "
                           "with_epoch=True) never advanced: every pass then draws the same (docs/data.md)")
    return None
