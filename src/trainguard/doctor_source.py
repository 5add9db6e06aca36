"""The doctor's checks that read the training script's source (:mod:`trainguard.doctor` runs them).

Static, on the script's text only (``Settings.source``): ``stage_in_background=True`` with no
``wait_staged()`` anywhere, a ``DataLoader`` without its own ``generator=``, and a save that only
rank 0 reaches, a global seed set after the restore (:mod:`trainguard.doctor_rng`). Each check returns ``None`` when there is no source to read (or it does not parse).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Any

from .doctor import Finding, Settings, _calls
from .doctor_rng import reseed

_SAVE_CALLS = {"save", "save_checkpoint", "async_save", "save_state"}  # accelerate: accelerator.save_state(dir)
_FOREIGN_SAVES = {"np", "numpy", "wandb", "mlflow", "joblib", "pickle", "plt", "json", "OmegaConf",  # not checkpoints
                  "cfg", "config", "conf", "tokenizer"}  # OLMo's train.py: cfg.save(save_folder / "config.yaml")
_EXPORTS = {"torch", "accelerator", "xm"}  # torch.save and its wrappers: an export, or a partial checkpoint
_RANK_ZERO_FLAGS = {"is_main_process", "is_rank_zero", "is_master", "master_process", "rank_zero", "is_global_zero",
                    "is_primary"}  # timm: utils.is_primary(args)
_FLIP = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(), ast.GtE: ast.LtE()}


def defines_hook(tree: ast.Module) -> bool:
    """Whether the module may bind ``trainguard_state`` (a def, an assignment, an import, or a
    ``from x import *``). ``trainguard doctor`` calls this before importing a script: one without
    the hook is not imported, so a script that trains at module level (nanoGPT's train.py) does not
    start training, load data or write checkpoints."""
    for n in ast.walk(tree):
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
    from .doctor_signals import worker_signals

    checks = (staging, loader_generator, single_rank, reseed, worker_signals)
    return [f for c in checks if (f := c([], settings)) is not None]


def _tree(s: Settings) -> ast.Module | None:
    if s.source is None:
        return None
    try:
        return ast.parse(s.source)
    except SyntaxError:
        return None


def staging(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """docs/async.md: with ``stage_in_background=True`` the caller must wait for ``handle.wait_staged()``."""
    if (tree := _tree(s)) is None:
        return None
    on = [(n, k) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
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


def single_rank(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    if (tree := _tree(s)) is None:
        return None
    calls: list[ast.Call] = []
    helpers, aliases = _save_helpers(tree), _rank_aliases(tree)
    flags = _rank_flags(tree, aliases)
    names = _SAVE_CALLS | set(helpers)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (zero := _rank_zero(node.test, aliases, flags)) is not None:
            branch, other = (node.body, node.orelse) if zero else (node.orelse, node.body)  # `if rank != 0: ... else: save()`
            also = {_callee(c) for c in _calls(None, names, ast.Module(body=other, type_ignores=[]))}
            calls += [c for c in _calls(None, names, ast.Module(body=branch, type_ignores=[]))
                      if _callee(c) not in also]  # metaseq: `if rank == 0 and profile: train() else: train()`
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "rank_zero" in ast.unparse(d) for d in node.decorator_list):
            calls += _calls(None, names, node)
        for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            calls += _after_exit(block, names, aliases, flags) if isinstance(block, list) else []
    objs = _rank0_objects(tree, aliases, flags)  # a saver made on rank 0 only: its saves are rank 0's wherever they are
    calls += [c for c in ast.walk(tree) if isinstance(c, ast.Call) and _receiver(c) in objs
              and _callee(c).startswith("save") and isinstance(c.func, ast.Attribute)
              and isinstance(c.func.value, ast.Name)]
    exports = _EXPORTS | objs  # like torch.save: rank 0's own file, not a collective save
    owner = [(c.lineno, _save_receiver(c, helpers)) for c in calls]
    hits = sorted({n for n, r in owner if r not in _FOREIGN_SAVES and r not in exports})
    if hits:
        via = ", ".join(sorted({_callee(c) for c in calls if _callee(c) in helpers and c.lineno in hits}))
        return Finding("all ranks save", "error", f"save called{f' (in {via})' if via else ''} under a rank-0 "
                       "condition (line "
                       f"{', '.join(map(str, hits))}): the other ranks' shards, RNG and data positions are never "
                       "written, and a collective save waits forever for them", "call mgr.save(step, state) on "
                       "every rank; trainguard decides which rank writes what")
    if torch_saves := sorted({n for n, r in owner if r in exports}):
        names = ", ".join(sorted({f"{r}.save" if r in _EXPORTS else f"{r}.{_callee(c)} ({r} is made on rank 0 only)"
                                  for c, (_, r) in zip(calls, owner) if r in exports}))
        if via := sorted({_callee(c) for c in calls if _callee(c) in helpers and _save_receiver(c, helpers) in _EXPORTS}):
            names += f" (in {', '.join(via)})"
        return Finding("all ranks save", "warning", f"{names} under a rank-0 condition (line "
                       f"{', '.join(map(str, torch_saves))}): fine to export a replicated (DDP) model's weights, "
                       "but as a checkpoint it misses FSDP shards and every other rank's RNG and data position",
                       "checkpoint with mgr.save(step, state) on every rank; keep rank-0 torch.save for exports")
    return Finding("all ranks save", "ok", "no save under a rank-0 condition")


def _after_exit(block: list[ast.stmt], names: set[str], aliases: frozenset[str], flags: frozenset[str]) -> list[ast.Call]:
    """``single_rank``: the saves in ``block`` after an ``if rank != 0:`` whose body returns, continues,
    breaks or raises (only rank 0 reaches them), less those that body makes too."""
    for i, st in enumerate(block):
        if isinstance(st, ast.If) and not st.orelse and st.body and isinstance(
                st.body[-1], (ast.Return, ast.Continue, ast.Break, ast.Raise)) and _rank_zero(st.test, aliases, flags) is False:
            also = {_callee(c) for c in _calls(None, names, ast.Module(body=st.body, type_ignores=[]))}
            return [c for c in _calls(None, names, ast.Module(body=block[i + 1:], type_ignores=[])) if _callee(c) not in also]
    return []


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _save_receiver(call: ast.Call, helpers: dict[str, str | None]) -> str | None:
    """The receiver of the save ``call`` makes: its own, or, for a helper of the script's own
    (``self._save_snapshot(epoch)``), that of the save inside it (``torch``)."""
    if _callee(call) in helpers and _receiver(call) in (None, "self", "cls"):
        return helpers[_callee(call)]
    return _own_receiver(call)


def _own_receiver(call: ast.Call) -> str | None:
    """``_receiver``; ``accelerator.save_state`` (collective: every rank calls it) is no export."""
    r = _receiver(call)
    return f"{r}.{_callee(call)}" if r in _EXPORTS and _callee(call) != "save" else r


def _save_helpers(tree: ast.Module) -> dict[str, str | None]:
    """Functions and methods of the script that save, by name, with the receiver of their save:
    ``_save_snapshot`` -> ``torch`` for pytorch/examples' DDP tutorial, whose rank-0 branch calls
    ``self._save_snapshot(epoch)`` and that calls ``torch.save``. Helpers of helpers are followed."""
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found: dict[str, str | None] = {}
    for _ in range(4):
        before = len(found)
        for f in funcs:
            for c in (() if f.name in found else _calls(None, _SAVE_CALLS | set(found), f)):
                name, r = _callee(c), _receiver(c)
                if name == f.name and r in (None, "self", "cls"):
                    continue  # itself
                if name in found and r in (None, "self", "cls"):
                    found[f.name] = found[name]
                    break
                if name in _SAVE_CALLS and r not in _FOREIGN_SAVES:
                    found[f.name] = _own_receiver(c)
                    break
        if len(found) == before:
            break
    return found


def _rank0_objects(tree: ast.Module, aliases: frozenset[str], flags: frozenset[str] = frozenset()) -> frozenset[str]:
    """Names bound to an object on rank 0 only, ``None`` elsewhere: timm's train.py, ``saver = None``
    then ``if utils.is_primary(args): saver = utils.CheckpointSaver(...)``."""
    zero = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and _rank_zero(n.test, aliases, flags)
            for b in n.body for x in ast.walk(b)}
    inside, other = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(t := n.targets[0], ast.Name):
            if id(n) in zero and isinstance(n.value, ast.Call):  # not wandb.init(...) and the like
                root = next((x.id for x in ast.walk(n.value.func) if isinstance(x, ast.Name)), None)
                (other if root in _FOREIGN_SAVES else inside).add(t.id)
            elif id(n) in zero or not _is_none(n.value):
                other.add(t.id)
    return frozenset(inside - other)


def _rank_aliases(tree: ast.Module) -> frozenset[str]:
    """Names assigned a rank under another name: ``self.gpu_id = int(os.environ["LOCAL_RANK"])``."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and _mentions_rank(n.value):
            t = n.targets[0]
            if isinstance(t, (ast.Name, ast.Attribute)):
                out.add(t.id if isinstance(t, ast.Name) else t.attr)
    return frozenset(out)


def _rank_flags(tree: ast.Module, aliases: frozenset[str]) -> frozenset[str]:
    """Names assigned a rank-0 test (torchtune: ``self._is_rank_zero = self.rank == 0``), for ``single_rank``."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(t := n.targets[0], (ast.Name, ast.Attribute)) \
                and isinstance(n.value, (ast.Compare, ast.BoolOp, ast.UnaryOp)) and _rank_zero(n.value, aliases) is True:
            out.add(t.id if isinstance(t, ast.Name) else t.attr)
    return frozenset(out)


def _receiver(call: ast.Call) -> str | None:
    """``torch`` for ``torch.save(...)``, ``mgr`` for ``self.mgr.save(...)``, None for a bare ``save(...)``."""
    v = getattr(call.func, "value", None)
    return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None


def _rank_zero(test: ast.expr, aliases: frozenset[str] = frozenset(), flags: frozenset[str] = frozenset()) -> bool | None:
    """True if ``test`` holds on rank 0 only (``rank == 0``, ``not rank``, ``is_main_process``), False if
    it fails on rank 0 only (``rank != 0``, ``rank > 0``, ``not is_main_process``), else None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _rank_zero(test.operand, aliases, flags)
        return (not inner) if inner is not None else (True if _mentions_rank(test.operand, aliases) else None)
    if isinstance(test, ast.BoolOp):
        parts = [_rank_zero(v, aliases, flags) for v in test.values]
        if True in parts:  # `rank == 0 and ...`; `rank == 0 or step % 100 == 0`: rank 0 saves more often
            return True
        return False if isinstance(test.op, ast.Or) and False in parts else None  # `rank != 0 or ...`: else
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            return None
        (op,), left, right = test.ops, test.left, test.comparators[0]
        if isinstance(left, ast.Constant):  # `0 == rank`, `0 < rank`: the rank on the left
            left, right, op = right, left, _FLIP.get(type(op), op)
        if isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod) and not isinstance(left.right, ast.Constant):
            left = left.left  # imagenet's `args.rank % ngpus_per_node == 0`: the first rank of each node
        if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.List, ast.Tuple, ast.Set)) \
                and _mentions_rank(left, aliases):  # HF's older examples: `args.local_rank in [-1, 0]`
            ns = [n for e in right.elts if type(n := _literal(e)) is int]
            return isinstance(op, ast.In) if len(ns) == len(right.elts) and 0 in ns and max(ns) <= 0 else None  # -1: one process
        if not (_mentions_rank(left, aliases) and isinstance(right, ast.Constant) and type(right.value) is int):
            return None
        n = right.value
        if n == 0 and isinstance(op, (ast.Eq, ast.Is, ast.LtE)) or n == 1 and isinstance(op, ast.Lt):
            return True  # rank == 0, rank <= 0, rank < 1
        if n == 0 and isinstance(op, (ast.NotEq, ast.IsNot, ast.Gt)) or n == 1 and isinstance(op, ast.GtE):
            return False  # rank != 0, rank > 0, rank >= 1
        return None
    f = test.func if isinstance(test, ast.Call) else test  # is_main_process, acc.is_main_process, is_rank_zero()
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name.lstrip("_") in _RANK_ZERO_FLAGS or name in flags:  # torchtune: self._is_rank_zero
        return True
    return None



def _mentions_rank(x: ast.expr, aliases: frozenset[str] = frozenset()) -> bool:
    """Whether ``x`` is a process rank: a name or attribute with "rank" as a word of it (``rank``,
    ``args.local_rank``, ``dist.get_rank()``, ``self.global_rank``) or an environment lookup of one
    (``int(os.environ["RANK"])``, ``os.environ.get("RANK")``); not ``rank % 2`` nor ``ranking_every``
    (``_rank_zero`` reads ``rank % ngpus_per_node``, a modulus that is no literal, as the local rank)."""
    if isinstance(x, ast.Call):
        if isinstance(x.func, ast.Name) and x.func.id == "int" and x.args:
            return _mentions_rank(x.args[0], aliases)
        if isinstance(x.func, ast.Attribute) and x.func.attr in ("get", "getenv") and x.args:
            return isinstance(x.args[0], ast.Constant) and _rank_word(str(x.args[0].value))
        x = x.func
    if isinstance(x, ast.Subscript):
        return isinstance(x.slice, ast.Constant) and _rank_word(str(x.slice.value))
    name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else ""
    return _rank_word(name) or name in aliases


def _rank_word(name: str) -> bool:
    return re.search(r"(^|_)rank($|_)", name.lower()) is not None


def _literal(node: ast.expr) -> Any:  # a literal's value, -1 (a unary minus) included, else None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


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
    for n in ast.walk(tree):
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
