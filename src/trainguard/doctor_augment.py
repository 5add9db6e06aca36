"""The doctor's "worker randomness" check (``doctor.check`` and ``doctor_source.check_source`` call
it, through ``doctor_source.augment``, on the script's source): a dataset of the script that draws
from a global generator (``random.random()``, ``np.random.rand()``, ``torch.rand(...)`` without
``generator=``) in its methods, read by a ``DataLoader`` that may start worker processes. torch seeds
each worker's generators from the loader's base seed and the worker id, so what a sample draws
depends on which samples that worker read since its iterator started: after a resume mid-epoch
the same sample is augmented differently (docs/data.md, "Draws in worker processes").
``tg.SeededDataset`` draws from ``(seed, epoch, index)`` instead (and seeds the batch's
``collate_fn``); a script that uses it is ok. Draws in a ``worker_init_fn`` and in a
``ResumableIterable``'s ``transform`` without ``seed=`` are reported too, and a generator made without
a seed in worker code (SeededDataset or not). Which code runs in the workers, and which calls draw:
``doctor_augscope`` (transform classes, the script's functions they call, imported names).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from .doctor_augscope import dataset_classes, global_draw, names, own_draws, unseeded, worker_code
from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings
    from .doctor_augscope import Names


def _draws(fn: ast.AST, nm: Names) -> list[ast.Call]:
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and global_draw(c, nm)]


def _functions(tree: ast.Module, call: ast.Call, args: tuple[str, ...]) -> list[tuple[str, ast.AST]]:
    """The functions of the script passed by name (or as a lambda) as keyword ``args`` of ``call``."""
    defs = {n.name: n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out: list[tuple[str, ast.AST]] = []
    for k in call.keywords:
        if k.arg in args and isinstance(k.value, ast.Lambda):
            out.append((k.arg, k.value))
        elif k.arg in args and isinstance(k.value, ast.Name) and k.value.id in defs:
            out.append((f"{k.arg} {k.value.id}", defs[k.value.id]))
    return out


def worker_draws(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for global-generator draws in a dataset class's methods, or a worker loader's
    ``collate_fn``, when a ``DataLoader`` of the script may start workers and ``SeededDataset``
    appears nowhere (module doc); ``ok`` with it. Always one for draws in a worker loader's
    ``worker_init_fn`` (SeededDataset does not cover it) and in the ``transform=`` of a
    ``ResumableIterable`` without ``seed=``. ``None`` without source, such a loader or such a draw."""
    from .doctor import Finding
    from .doctor_signals import _workers
    from .doctor_source import _calls, _tree

    if (tree := _tree(s)) is None:
        return None
    loaders = [c for c in _calls(None, {"DataLoader"}, tree) if _workers(c, tree)]
    if not loaders:  # no worker process: the draws are the training process's (RNGState)
        return None
    nm = names(tree)
    for call in _calls(None, {"ResumableIterable"}, tree):  # its transform runs in the workers: seed= seeds it
        if not any(k.arg == "seed" for k in call.keywords):
            for where, fn in _functions(tree, call, ("transform",)):
                if draws := _draws(fn, nm):
                    return Finding("worker randomness", "warning", f"line {draws[0].lineno}: {ast.unparse(draws[0])} in "
                                   f"{where} of a ResumableIterable without seed= draws from the global generator of "
                                   "a DataLoader worker: after a resume the same items are transformed differently",
                                   "pass ResumableIterable(..., seed=0): each item's transform is then seeded from "
                                   "(seed, epoch, item index) (docs/data.md)")
    for where, fn in (f for c in loaders for f in _functions(tree, c, ("worker_init_fn",))):
        draws = [c for c in _draws(fn, nm) if not (isinstance(c.func, ast.Attribute) and "seed" in c.func.attr)]
        if draws:
            return Finding("worker randomness", "warning", f"line {draws[0].lineno}: {ast.unparse(draws[0])} in {where} "
                           "draws from a worker's generators, seeded from the loader's base seed, which a resumed "
                           "process draws at another point: it draws differently after a resume",
                           "derive what worker_init_fn draws from its worker_id alone, or draw it in the dataset")
    hits: list[tuple[ast.Call, str]] = []
    own: dict[int, str] = {}  # id of a call that draws from a generator its object keeps: "dataset" or "transform"
    fresh: list[tuple[ast.Call, str]] = []  # a generator made without a seed, per call
    datasets = {id(d) for d in dataset_classes(tree)}
    for where, cls, fn in worker_code(tree, loaders):
        for c in ast.walk(fn):
            if isinstance(c, ast.Call) and unseeded(c, nm):
                fresh.append((c, where))
            elif isinstance(c, ast.Call) and global_draw(c, nm):
                hits.append((c, where))
        if cls is not None:
            mine = own_draws(cls, [fn])
            own.update({id(c): "dataset" if id(cls) in datasets else "transform" for c in mine})
            hits += [(c, where) for c in mine]
    hits += [(c, where) for ld in loaders for where, fn in _functions(tree, ld, ("collate_fn",)) for c in _draws(fn, nm)]
    if fresh:  # no seeding repeats it, SeededDataset's neither
        c, where = min(fresh, key=lambda h: (h[0].lineno, h[0].col_offset))
        return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} makes a "
                       "generator without a seed, from fresh OS entropy, each time it runs: no resume (and no "
                       "seeding, tg.SeededDataset's neither) draws those numbers again", "give it a seed made from "
                       "what it augments, e.g. np.random.default_rng((epoch, index)), or draw from the global "
                       "generator under tg.SeededDataset (docs/data.md)")
    if not hits:
        return None
    c, where = min(hits, key=lambda h: (h[0].lineno, h[0].col_offset))
    if any(isinstance(n, ast.Name) and n.id == "SeededDataset" or isinstance(n, ast.Attribute) and n.attr == "SeededDataset"
           for n in walk(tree)):  # used, not a comment's word
        return Finding("worker randomness", "ok", f"{where} draws from a {'generator it keeps' if id(c) in own else 'global generator'} (line {c.lineno}) and "
                       "the script uses tg.SeededDataset")
    if id(c) in own:
        return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} draws from "
                       f"a generator the {own[id(c)]} keeps: each DataLoader worker draws on from its own copy of it, and "
                       "no checkpoint holds it, so after a resume mid-epoch the same samples are augmented "
                       "differently", "wrap the dataset: DataLoader(tg.SeededDataset(dataset, seed=0), "
                       "sampler=tg.ResumableSampler(..., with_epoch=True), ...): it seeds the dataset's own "
                       "generators per sample too (docs/data.md)")
    return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} draws from "
                   "the global generator of a DataLoader worker, which torch seeds from the loader's base seed and "
                   "the worker id: what a sample draws depends on the samples its worker read before, so after a "
                   "resume mid-epoch the same samples are augmented differently", "wrap the dataset: "
                   "DataLoader(tg.SeededDataset(dataset, seed=0), sampler=tg.ResumableSampler(..., "
                   "with_epoch=True), ...) (docs/data.md)")
