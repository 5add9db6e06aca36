"""The doctor's "data position" check (``doctor.check`` runs it on the state, with the script's source).

A state with no object that keeps the data position is an error (a resume replays or skips data),
or a warning when it holds a data counter or an object of the script's own that may hold it, unless
the script saves inside its loop over a ``DataLoader`` and skips no batches after a resume: then a
resume mid-epoch starts the loader's epoch again and trains on the batches before the save twice
(an error; seen: a ``DistributedSampler`` loop saving ``epoch * len(loader) + i``, resumed at step 9,
trained its epoch from batch 0 again and ``save(step=8)`` was refused).

What counts as a data position:

An object that keeps one: a sampler or data loader with a ``state_dict`` (``tg.ResumableSampler``,
torchdata's ``StatefulDataLoader``), or an iterable dataset with one (``tg.ResumableIterable``, a
stream of the script's own with ``state_dict``/``load_state_dict``; before, ``tg.ResumableIterable``
in the state was reported as "no sampler or data loader with a state_dict").

A counter that may stand for one: a number in the state named for how far the data went, such as
``epoch``, ``samples_seen``, ``consumed_samples``, ``batch_idx``, ``num_batches_done``: a word of
its name is a unit of data (sample, batch, epoch) and every other word says where the data stands
(seen, consumed, done, index, global, total, ...). A name with any other word counts something else:
an early-stopping counter (``bad_epochs``, ``epochs_without_improvement``), ``best_epoch``,
``batch_size``, ``max_epochs``, ``epoch_loss`` (before, any name containing "sample", "epoch" or
"batch" was taken for a data counter, and ``bad_epochs`` hid the missing data position).
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_TORCH_SAMPLERS = {"DistributedSampler", "RandomSampler", "SequentialSampler", "WeightedRandomSampler",
                   "SubsetRandomSampler", "BatchSampler"}  # none keeps a position
_UNITS = {"sample", "samples", "epoch", "epochs", "batch", "batches"}
_WHERE = {"seen", "consumed", "done", "processed", "completed", "trained", "read", "passed", "finished", "elapsed",
          "idx", "index", "count", "counter", "cnt", "num", "n", "nb", "cur", "current", "curr", "global", "total",
          "step", "steps", "iter", "it", "start", "starting", "pos", "position", "offset", "next", "last", "this",
          "data", "train", "training", "so", "far", "in", "of", "at"}


def keeps_position(x: Any) -> bool:
    """A sampler, loader or iterable dataset whose ``state_dict`` holds where the data stands."""
    import torch

    name = type(x).__name__
    return callable(getattr(x, "state_dict", None)) and (
        "Sampler" in name or "DataLoader" in name or isinstance(x, torch.utils.data.IterableDataset)
        and callable(getattr(x, "load_state_dict", None)))


def data_counter(path: str, x: Any) -> bool:
    """Whether the state's entry at ``path`` is a number named as a data counter (module doc)."""
    import torch

    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            return False
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    last = path.rsplit("/", 1)[-1]
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", last).lower()) if w]
    return any(w in _UNITS for w in words) and all(w in _UNITS or w in _WHERE or w.isdigit() for w in words)


def data_position(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    """The "data position" finding (module doc); any rank, no I/O."""
    from .doctor import Finding, _name, _own_stateful

    ok = [(p, x) for p, x in leaves if keeps_position(x)]
    if ok:
        return Finding("data position", "ok", f"data position saved ({ok[0][0]}: {_name(ok[0][1])})")
    plain = [f"{p} is a {_name(x)}, which has no state_dict" for p, x in leaves
             if "Sampler" in _name(x) or "DataLoader" in _name(x)]
    counters = [p for p, x in leaves if data_counter(p, x)]
    why = "; ".join(plain) or "no sampler or data loader with a state_dict in the state"
    fix = 'use tg.ResumableSampler (or torchdata\'s StatefulDataLoader) and add it: state["data"] = sampler'
    own = [] if plain else _own_stateful(leaves)
    if counters and not plain:
        why = f"{why}; only a counter ({counters[0]}): a resume is exact only if your loader skips ahead by exactly that much"
    elif own:  # a stateful object of the user's own (a resumable dataset/iterator) may well hold the position
        why = f"{why}, unless {own[0][0]} ({_name(own[0][1])}) holds it"
    else:
        return Finding("data position", "error", f"{why}: a resume replays or skips data", fix)
    if (loop := mid_epoch(s.source)) is None:
        return Finding("data position", "warning", why, fix)
    return Finding("data position", "error", f"{why}; but the script saves inside its loop over a DataLoader (line "
                   f"{loop.lineno}: for {_target(loop.target)} in {ast.unparse(loop.iter)}) and skips no batch "
                   "after a resume: a resume mid-epoch starts that loader's epoch again, training on the batches "
                   "before the save twice (with shuffling, in another order)", fix)


def _target(t: ast.expr) -> str:
    """A loop's target as written: ``i, (x, y)``, not ast.unparse's ``(i, (x, y))``."""
    return ", ".join(ast.unparse(e) for e in t.elts) if isinstance(t, ast.Tuple) else ast.unparse(t)


def mid_epoch(source: str | None) -> ast.For | None:
    """The first ``for`` loop over a ``DataLoader`` whose sampler keeps no position (none given, or one
    of torch's, ``DistributedSampler(...)``; built in the call, or a name assigned only such loaders;
    through ``enumerate``/``tqdm``/``zip``) whose body saves (``mgr.save``, or a function of the script
    that saves), not under an ``if`` on a ``len(...)`` (the epoch's last batch), in a function that
    skips no batches (no ``islice``, ``skip_first_batches``, nor an ``if ...: continue`` in the loop)."""
    from .doctor_accum import _is_save
    from .doctor_parse import parse
    from .doctor_restore import _savers
    from .doctor_resume import _pairs
    from .doctor_source import _callee, _own_nodes

    if (tree := parse(source)) is None:
        return None
    built: dict[str, list[ast.AST | None]] = {}  # what each name is assigned (tuples item by item; None: unpacked)
    for n in walk(tree):
        for t, v in _pairs(n):
            if isinstance(t, ast.Name):
                built.setdefault(t.id, []).append(v)
    plain = {name for name, values in built.items()
             if all(isinstance(v, ast.Call) and _callee(v) in _TORCH_SAMPLERS for v in values)}

    def forgets(c: ast.AST | None) -> bool:
        """A DataLoader(...) whose sampler keeps no position: none given, or one of torch's."""
        if not (isinstance(c, ast.Call) and _callee(c) == "DataLoader" and len(c.args) < 4):
            return False  # a sampler given as the 4th argument: not read
        given = [k.value for k in c.keywords if k.arg in ("sampler", "batch_sampler", None)]
        return all(
            isinstance(v, ast.Call) and _callee(v) in _TORCH_SAMPLERS or isinstance(v, ast.Name) and v.id in plain
            or isinstance(v, ast.Constant) and v.value is None for v in given)
    loaders = {name for name, values in built.items() if all(forgets(v) for v in values)}
    savers = _savers(tree)
    for scope in [tree, *(n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        nodes = list(_own_nodes(scope))
        if any(isinstance(c, ast.Call) and _callee(c) in ("islice", "skip_first_batches") for c in nodes):
            continue
        for loop in (n for n in nodes if isinstance(n, ast.For)):
            it = loop.iter
            while isinstance(it, ast.Call) and _callee(it) in ("enumerate", "tqdm", "zip") and it.args:
                it = it.args[0]
            if not (forgets(it) or isinstance(it, ast.Name) and it.id in loaders):
                continue
            if any(isinstance(x, ast.If) and any(isinstance(y, ast.Continue) for y in ast.walk(x)) for x in ast.walk(loop)):
                continue
            ends = {id(y) for x in ast.walk(loop) if isinstance(x, ast.If) and any(
                isinstance(c, ast.Call) and _callee(c) == "len" for c in ast.walk(x.test)) for y in ast.walk(x)}
            if any(isinstance(c, ast.Call) and id(c) not in ends and (_is_save(c) or _callee(c) in savers)
                   for c in ast.walk(loop)):
                return loop
    return None
