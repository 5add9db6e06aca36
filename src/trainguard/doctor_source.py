"""The doctor's checks that read the training script's source (:mod:`trainguard.doctor` runs them).

Static, on the script's text only (``Settings.source``): ``stage_in_background=True`` with no
``wait_staged()`` anywhere, a ``DataLoader`` without its own ``generator=`` or with
``in_order=False``, a save that only rank 0 reaches (:mod:`trainguard.doctor_rank`), a global
seed set after the restore (:mod:`trainguard.doctor_rng`), a generator object of the script drawn
from at each step but not saved (:mod:`trainguard.doctor_gens`), a weight average (EMA) updated in
the loop but not saved (:mod:`trainguard.doctor_ema`), a persistent-worker loader seeded at each pass
(:mod:`trainguard.doctor_persist`), a ``ReduceLROnPlateau`` fed a sum kept in a loop variable
(:mod:`trainguard.doctor_accvar`), a training loop that starts over after the restore
(:mod:`trainguard.doctor_resume`). Each check returns ``None`` when
there is no source to read (or it does not parse).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .doctor import Finding, Settings, _calls
from .doctor_parse import walk
from .doctor_passloader import pass_only
from .doctor_rng import reseed


def read_source(path: Path) -> str:
    """``trainguard doctor``'s script as Python reads it: its PEP 263 coding line, else UTF-8
    (undecodable bytes replaced)."""
    data = path.read_bytes()
    try:
        return importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", errors="replace")


def defines_hook(tree: ast.Module) -> bool:
    """Whether the module may bind ``trainguard_state`` (a def, an assignment, an import, or a
    ``from x import *``). ``trainguard doctor`` calls this before importing a script: one without
    the hook is not imported, so a script that trains at module level (nanoGPT's train.py) does not
    start training, load data or write checkpoints."""
    for n in walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == "trainguard_state":
            return True
        if isinstance(n, ast.Name) and n.id == "trainguard_state" and isinstance(n.ctx, ast.Store):
            return True
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any(
                a.name == "*" or (a.asname or a.name).split(".")[0] == "trainguard_state" for a in n.names):
            return True
    return False


def check_source(settings: Settings) -> list[Finding]:
    """The checks that read only the script's source (no state): what ``trainguard doctor`` reports
    for a script without a ``trainguard_state()`` hook."""
    return [f for c in source_checks() if (f := c([], settings)) is not None]


def source_checks() -> tuple[Callable[[list[tuple[str, Any]], Settings], Finding | None], ...]:
    """The checks on the script's source, in report order: ``check_source`` runs them, and
    ``doctor.check`` after its checks of the state."""
    from .doctor_accvar import loop_accumulator
    from .doctor_importdraw import draw_before_seed
    from .doctor_onefile import one_file
    from .doctor_persist import pass_seeding
    from .doctor_resume import resume_start
    from .doctor_signals import worker_signals

    return (staging, loader_generator, loader_order, single_rank, one_file, reseed, draw_before_seed, own_generators, ema, worker_signals,
            accum, augment, pass_seeding, loop_accumulator, restore_loop, restore_after, resume_start)


def _tree(s: Settings) -> ast.Module | None:
    if s.source is None:
        return None
    from .doctor_parse import parse

    return parse(s.source)


def staging(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """docs/async.md: with ``stage_in_background=True`` the caller must wait for ``handle.wait_staged()``."""
    if (tree := _tree(s)) is None:
        return None
    on = [(n, k) for n in walk(tree) if isinstance(n, ast.Call) for k in n.keywords
          if k.arg == "stage_in_background" and not (isinstance(k.value, ast.Constant) and not k.value.value)]
    if not on and not s.stage_in_background:
        return None
    where = (f"stage_in_background={ast.unparse(on[0][1].value)} (line {on[0][0].lineno})" if on
             else "the manager's stage_in_background=True")
    if waits := next(_calls(None, {"wait_staged"}, tree), None):
        return Finding("background staging", "ok", f"{where}; the script waits for staging (line {waits.lineno}: "
                       f"{ast.unparse(waits)})")
    return Finding("background staging", "error", f"{where} but the script never calls wait_staged(): the save "
                   "thread copies the tensors after save() returns, so the next forward (module buffers) or any "
                   "in-place update outside optimizer.step() can change them mid-copy, a torn checkpoint that "
                   "nothing detects", "keep the handle, h = mgr.save(step, state), and call h.wait_staged() before "
                   "anything writes into a tensor of the state (the next forward included), or drop "
                   "stage_in_background=True")


def loader_generator(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """docs/data.md, "Randomness in the data pipeline": a DataLoader without ``generator=`` draws
    its base seed from the global torch generator each time its iterator starts."""
    if (tree := _tree(s)) is None:
        return None
    loaders = list(_calls(None, {"DataLoader"}, tree))
    if not loaders:
        return None
    # generator=None is the default, spelled out. A **kw is read where the script builds it
    # (pytorch/examples' mnist: train_kwargs = {...}; train_kwargs.update(cuda_kwargs)); one built
    # out of sight may carry generator=, and is not reported.
    def keys(c: ast.Call) -> set[str] | None:
        out: set[str] | None = {k.arg for k in c.keywords if k.arg and not (k.arg == "generator" and _is_none(k.value))}
        for k in c.keywords:
            if k.arg is None:
                more = _dict_keys(tree, k.value)
                out = None if out is None or more is None else out | more
        return out

    resolved = [(c, keys(c)) for c in loaders]
    bare = [c for c, ks in resolved if ks is not None and "generator" not in ks]
    passes = [c for c in bare if pass_only(tree, c)]
    bare = [c for c in bare if c not in passes]
    if not bare and passes:
        return Finding("data randomness", "ok", f"the DataLoader (line {passes[0].lineno}) without generator= is "
                       "only iterated in passes that neither save nor train: each pass starts its iterator at the "
                       "same point of the global stream, which tg.RNGState saves")
    if not bare:
        own = [c for c, ks in resolved if ks is not None]
        if own:
            return Finding("data randomness", "ok", f"the DataLoader has its own generator (line {own[0].lineno})")
        c = loaders[0]
        return Finding("data randomness", "info", f"not checked: the DataLoader (line {c.lineno}) takes "
                       f"{', '.join('**' + ast.unparse(k.value) for k in c.keywords if k.arg is None)}, built out of "
                       "sight of the script's text: it may or may not carry generator=",
                       "make sure the keyword arguments include generator=torch.Generator()")
    lines = ", ".join(str(c.lineno) for c in bare)
    return Finding("data randomness", "warning", f"DataLoader without generator= (line {lines}): each time its "
                   "iterator starts (every epoch, and once after a restore) it draws a seed from the global torch "
                   "generator; a resumed run draws it at another point of that stream, so dropout and every later "
                   "draw differ from the uninterrupted run", "DataLoader(..., generator=torch.Generator()); for "
                   "augmentation drawn in workers see tg.SeededDataset (docs/data.md)")


def loader_order(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """docs/data.md: ``DataLoader(in_order=False)`` hands batches out in the order its workers finish
    them, while ``ResumableSampler.advance(n)`` records a *prefix* of the sampler's order as consumed:
    a resume re-reads batches that were consumed and never reads some that were not."""
    if (tree := _tree(s)) is None:
        return None
    off = [(c, k) for c in _calls(None, {"DataLoader"}, tree) for k in c.keywords
           if k.arg == "in_order" and not (isinstance(k.value, ast.Constant) and k.value.value is True)]
    if not off:
        return None
    c, k = off[0]
    return Finding("data order", "warning", f"DataLoader(..., in_order={ast.unparse(k.value)}) (line {c.lineno}): "
                   "batches may come out of the order the sampler yielded them, but a checkpoint records the "
                   "data position as a count of samples from the start of that order; a resume then reads some "
                   "consumed batches again and never reads others that were not", "leave in_order=True (the "
                   "default) with tg.ResumableSampler")


def single_rank(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "all ranks save" check (:func:`trainguard.doctor_rank.single_rank`)."""
    from .doctor_rank import single_rank as check

    return check(leaves, s)


def accum(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "save mid-accumulation" check (:func:`trainguard.doctor_accum.mid_accumulation`)."""
    from .doctor_accum import mid_accumulation

    return mid_accumulation(leaves, s)


def augment(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "worker randomness" check (:func:`trainguard.doctor_augment.worker_draws`)."""
    from .doctor_augment import worker_draws

    return worker_draws(leaves, s)


def own_generators(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "own generators" check (:func:`trainguard.doctor_gens.own_generators`)."""
    from .doctor_gens import own_generators as check

    return check(leaves, s)


def ema(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "ema" check (:func:`trainguard.doctor_ema.unsaved_ema`)."""
    from .doctor_ema import unsaved_ema

    return unsaved_ema(leaves, s)


def restore_loop(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "restore in loop" check (:func:`trainguard.doctor_restore.restore_in_loop`)."""
    from .doctor_restore import restore_in_loop

    return restore_in_loop(leaves, s)


def restore_after(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """The "after restore" check (:func:`trainguard.doctor_restore.after_restore`)."""
    from .doctor_restore import after_restore

    return after_restore(leaves, s)


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _receiver(call: ast.Call) -> str | None:
    """``torch`` for ``torch.save(...)``, ``mgr`` for ``self.mgr.save(...)``, None for a bare ``save(...)``."""
    v = getattr(call.func, "value", None)
    return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _dict_keys(tree: ast.Module, node: ast.expr, depth: int = 0) -> set[str] | None:
    """The keys of a dict the script builds in plain sight: a literal or ``dict(k=...)``, or a name
    assigned one, plus its ``.update(...)``/``.setdefault("k", ...)``/``x["k"] = ...`` anywhere.
    ``None`` when any part is out of sight (a parameter, a function's result, a name passed to a call)."""
    if depth > 4:
        return None
    if isinstance(node, ast.Dict):
        out: set[str] = set()
        for k, v in zip(node.keys, node.values):
            more = {k.value} if isinstance(k, ast.Constant) and isinstance(k.value, str) else \
                _dict_keys(tree, v, depth + 1) if k is None else None
            if more is None:
                return None
            out |= more
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return _dict_keys(tree, ast.Dict(keys=[None if k.arg is None else ast.Constant(k.arg) for k in node.keywords],
                                         values=[k.value for k in node.keywords]), depth + 1)
    if not isinstance(node, ast.Name):
        return None
    name, found, out = node.id, False, set()
    for n in walk(tree):
        if isinstance(n, ast.arg) and n.arg == name or isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
            return None  # a parameter: filled by the caller
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == name:
                    more = None if n.value is None or isinstance(n, ast.AugAssign) else _dict_keys(tree, n.value, depth + 1)
                    if more is None:
                        return None
                    found, out = True, out | more
                elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                    if not (isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                        return None
                    out.add(t.slice.value)
                elif not isinstance(t, (ast.Name, ast.Subscript, ast.Attribute)) and any(
                        isinstance(x, ast.Name) and x.id == name for x in ast.walk(t)):
                    return None  # unpacked into: a, kw = f()
        elif isinstance(n, (ast.For, ast.With, ast.NamedExpr, ast.comprehension)) and any(
                isinstance(x, ast.Name) and x.id == name and isinstance(x.ctx, ast.Store) for x in ast.walk(
                    n.target if isinstance(n, (ast.For, ast.NamedExpr, ast.comprehension)) else n)):
            return None
        elif isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == name:
                if f.attr == "update":
                    parts = [_dict_keys(tree, a, depth + 1) for a in n.args] + [
                        _dict_keys(tree, k.value, depth + 1) if k.arg is None else {k.arg} for k in n.keywords]
                    if any(p is None for p in parts):
                        return None
                    out = out.union(*parts)
                elif f.attr == "setdefault" and n.args and isinstance(n.args[0], ast.Constant):
                    out.add(str(n.args[0].value))
                elif f.attr not in ("get", "items", "keys", "values", "copy", "pop"):
                    return None
            elif not (isinstance(f, ast.Attribute) and f.attr == "update" or isinstance(f, ast.Name) and f.id == "dict") \
                    and any(isinstance(a, ast.Name) and a.id == name for a in [*n.args, *(k.value for k in n.keywords
                                                                                      if k.arg is not None)]):
                return None  # handed to a function that may add to it (other.update(name) only reads it)
    return out if found else None


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a module or function, not those of the functions and classes inside it."""
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield child
            yield from _own_nodes(child)
