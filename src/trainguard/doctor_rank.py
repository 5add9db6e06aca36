"""The doctor's "all ranks save" check (``doctor.check`` and ``doctor_source.check_source`` call it,
through ``doctor_source.single_rank``, on the script's source): a save that only rank 0 reaches
(``if rank == 0: mgr.save(...)``), directly or through a function of the script that saves.

The tests that hold on rank 0 only (``rank == 0``, ``not rank``, ``is_main_process``...) are read
by :func:`_rank_zero`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from .doctor import Finding, Settings, _calls
from .doctor_imports import Reads, imported
from .doctor_parse import walk
from .doctor_source import _callee, _is_none, _receiver, _tree

_SAVE_CALLS = {"save", "save_checkpoint", "async_save", "save_state"}  # accelerate: accelerator.save_state(dir)
_FOREIGN_SAVES = {"np", "numpy", "wandb", "mlflow", "joblib", "pickle", "plt", "json", "OmegaConf",  # not checkpoints
                  "cfg", "config", "conf", "tokenizer", "parser"}  # OLMo's train.py: cfg.save(save_folder / "config.yaml")
_TEXT_FILES = (".yaml", ".yml", ".json", ".txt", ".csv", ".toml", ".md", ".png", ".jpg", ".svg")  # not checkpoints
_EXPORTS = {"torch", "accelerator", "xm"}  # torch.save and its wrappers: an export, or a partial checkpoint
_RANK_ZERO_FLAGS = {"is_main_process", "is_rank_zero", "is_master", "master_process", "rank_zero", "is_global_zero",
                    "is_primary",  # timm: utils.is_primary(args)
                    "is_master_ordinal", "is_local_main_process", "is_local_master",  # torch_xla, accelerate: per host
                    "is_world_process_zero", "is_local_process_zero"}  # transformers' Trainer
_FLIP = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(), ast.GtE: ast.LtE()}


def single_rank(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A save only rank 0 reaches: an error for a collective save (``mgr.save``, ``save_state``), a
    warning for ``torch.save`` and its wrappers (an export, or a partial checkpoint)."""
    if (tree := _tree(s)) is None:
        return None
    calls: list[ast.Call] = []
    known, mods = imported(tree, s.path, _module_helpers, reads=Reads("save"))  # DeepSpeed-Chat's save_hf_format
    mods -= _EXPORTS  # a torch.py of the project's own does not make torch.save one of its helpers
    helpers, aliases = _save_helpers(tree, known, mods), _rank_aliases(tree)
    flags = _rank_flags(tree, aliases)
    names = _SAVE_CALLS | set(helpers)
    for node in walk(tree):
        if isinstance(node, ast.If) and (zero := _rank_zero(node.test, aliases, flags)) is not None:
            branch, other = (node.body, node.orelse) if zero else (node.orelse, node.body)  # `if rank != 0: ... else: save()`
            calls += _only_here(branch, [other], names)  # metaseq: `if rank == 0 and profile: train() else: train()`
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "rank_zero" in ast.unparse(d) for d in node.decorator_list):
            calls += _calls(None, names, node)
        elif isinstance(node, ast.Match) and _mentions_rank(node.subject, aliases):  # match rank: case 0: save()
            for case in node.cases:
                if _zero_pattern(case.pattern):
                    calls += _only_here(case.body, [o.body for o in node.cases if o is not case], names)
        for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            calls += _after_exit(block, names, aliases, flags) if isinstance(block, list) else []
    objs = _rank0_objects(tree, aliases, flags)  # a saver made on rank 0 only: its saves are rank 0's wherever they are
    calls += [c for c in walk(tree) if isinstance(c, ast.Call) and _receiver(c) in objs
              and _callee(c).startswith("save") and isinstance(c.func, ast.Attribute)
              and isinstance(c.func.value, ast.Name)]
    own = {n.name for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    calls = [c for c in calls if not _text_file(c)]  # config.yaml, metrics.json
    calls = [c for c in calls if _callee(c) in _SAVE_CALLS or _callee(c) not in set(known) - own
             or _receiver(c) in (None, *mods)]  # an imported helper's name on another object: not that helper
    exports = _EXPORTS | objs  # like torch.save: rank 0's own file, not a collective save
    owner = [(c.lineno, _save_receiver(c, helpers, mods)) for c in calls]
    hits = sorted({n for n, r in owner if r not in _FOREIGN_SAVES and r not in exports})
    if hits:
        via = ", ".join(sorted({_callee(c) for c in calls if _callee(c) in helpers and c.lineno in hits}))
        return Finding("all ranks save", "error", f"save called{f' (in {via})' if via else ''} under a rank-0 "
                       "condition (line "
                       f"{', '.join(map(str, hits))}): the other ranks' shards, RNG and data positions are never "
                       "written, and a collective save waits forever for them", "call mgr.save(step, state) on "
                       "every rank; trainguard decides which rank writes what")
    if torch_saves := sorted({n for n, r in owner if r in exports}):
        said = ", ".join(sorted({f"{r}.save" if r in _EXPORTS else f"{r}.{_callee(c)} ({r} is made on rank 0 only)"
                                  for c, (_, r) in zip(calls, owner) if r in exports}))
        if inner := sorted({_callee(c) for c in calls if _callee(c) in helpers and _save_receiver(c, helpers, mods) in _EXPORTS}):
            said += f" (in {', '.join(inner)})"
        return Finding("all ranks save", "warning", f"{said} under a rank-0 condition (line "
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
            return _only_here(block[i + 1:], [st.body], names)
    return []


def _only_here(body: list[ast.stmt], others: list[list[ast.stmt]], names: set[str]) -> list[ast.Call]:
    """The calls of ``names`` in ``body`` whose callee none of the ``others`` blocks calls (a save
    made on every path is no rank-0 save)."""
    also = {_callee(c) for o in others for c in _calls(None, names, ast.Module(body=o, type_ignores=[]))}
    return [c for c in _calls(None, names, ast.Module(body=body, type_ignores=[])) if _callee(c) not in also]


def _save_receiver(call: ast.Call, helpers: dict[str, str | None], mods: frozenset[str] = frozenset()) -> str | None:
    """The receiver of the save ``call`` makes: its own, or, for a helper of the script's own
    (``self._save_snapshot(epoch)``) or of a local module (``utils.save_hf_format(...)``, ``utils``
    in ``mods``), that of the save inside it (``torch``)."""
    if _callee(call) in helpers and _receiver(call) in (None, "self", "cls", *mods):
        return helpers[_callee(call)]
    return _own_receiver(call)


def _own_receiver(call: ast.Call) -> str | None:
    """``_receiver``; ``accelerator.save_state`` (collective: every rank calls it) is no export."""
    r = _receiver(call)
    return f"{r}.{_callee(call)}" if r in _EXPORTS and _callee(call) != "save" else r


def _module_helpers(tree: ast.Module, path: Path, depth: int, reads: Reads) -> dict[str, str | None]:
    """``doctor_imports.imported`` calls this on each local module the script imports: its save helpers."""
    known, mods = imported(tree, path, _module_helpers, depth, reads)
    return _save_helpers(tree, known, mods - _EXPORTS)


def _save_helpers(tree: ast.Module, known: dict[str, str | None] | None = None,
                  mods: frozenset[str] = frozenset()) -> dict[str, str | None]:
    """Functions and methods of the script that save, by name, with the receiver of their save:
    ``_save_snapshot`` -> ``torch`` for pytorch/examples' DDP tutorial, whose rank-0 branch calls
    ``self._save_snapshot(epoch)`` and that calls ``torch.save``. Helpers of helpers are followed,
    ``known`` ones (imported from the local modules ``mods``: ``doctor_imports``) included."""
    funcs = [n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found: dict[str, str | None] = dict(known or {})
    mine = (None, "self", "cls", *mods)
    called = {id(f): [(c, _callee(c)) for c in ast.walk(f) if isinstance(c, ast.Call)] for f in funcs}  # one walk
    for _ in range(4):
        before = len(found)
        for f in funcs:
            for c, name in (() if f.name in found else called[id(f)]):
                if name not in _SAVE_CALLS and name not in found:
                    continue
                r = _receiver(c)
                if name == f.name and r in (None, "self", "cls"):
                    continue  # itself
                if name in found and r in mine:
                    found[f.name] = found[name]
                    break
                if name in _SAVE_CALLS and r not in _FOREIGN_SAVES and not _text_file(c):
                    found[f.name] = _own_receiver(c)
                    break
        if len(found) == before:
            break
    return found


def _text_file(call: ast.Call) -> bool:
    """Whether ``call`` names a text or image file, no checkpoint: litgpt's
    ``parser.save(config, checkpoint_dir / "hyperparameters.yaml")``, ``x.save(out / "config.json")``."""
    return any((_path_end(a) or "").lower().endswith(_TEXT_FILES) for a in [*call.args, *(k.value for k in call.keywords)])


def _path_end(x: ast.expr) -> str | None:
    """``_text_file``: the last literal text of an argument that is a path (``"a.yaml"``,
    ``f"{d}/a.yaml"``, ``d / "a.yaml"``, ``os.path.join(d, "a.yaml")``, ``"{}/a.yaml".format(d)``,
    ``"%s/a.yaml" % d``, ``str(d / "a.yaml")``);
    None for anything else: a string inside a dict or list saved (``metadata={"config": "7b.yaml"}``,
    ``torch.save({"cfg": "a.yaml", ...}, path)``) names no file written."""
    if isinstance(x, ast.Constant):
        return x.value if isinstance(x.value, str) else None
    if isinstance(x, ast.JoinedStr):
        return _path_end(x.values[-1]) if x.values else None
    if isinstance(x, ast.BinOp) and isinstance(x.op, (ast.Div, ast.Add, ast.Mod)):
        return _path_end(x.left if isinstance(x.op, ast.Mod) else x.right)
    if isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and x.func.attr == "format":
        return _path_end(x.func.value)
    if isinstance(x, ast.Call) and _callee(x) in ("join", "Path", "PurePath", "str", "fspath") and x.args:
        return _path_end(x.args[-1])
    return None


def _rank0_objects(tree: ast.Module, aliases: frozenset[str], flags: frozenset[str] = frozenset()) -> frozenset[str]:
    """Names bound to an object on rank 0 only, ``None`` elsewhere: timm's train.py, ``saver = None``
    then ``if utils.is_primary(args): saver = utils.CheckpointSaver(...)``."""
    zero = {id(x) for n in walk(tree) if isinstance(n, ast.If) and _rank_zero(n.test, aliases, flags)
            for b in n.body for x in ast.walk(b)}
    inside: set[str] = set()
    other: set[str] = set()
    for n in walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(t := n.targets[0], ast.Name):
            if id(n) in zero and isinstance(n.value, ast.Call):  # not wandb.init(...) and the like
                root = next((x.id for x in ast.walk(n.value.func) if isinstance(x, ast.Name)), None)
                (other if root in _FOREIGN_SAVES else inside).add(t.id)
            elif id(n) in zero or not _is_none(n.value):
                other.add(t.id)
    return frozenset(inside - other)


def _zero_pattern(p: ast.pattern) -> bool:
    """``single_rank``: whether a ``case`` pattern on the rank matches rank 0 and no other rank (``case 0:``,
    ``case 0 | -1:``)."""
    if isinstance(p, ast.MatchOr):
        ns = [_literal(x.value) if isinstance(x, ast.MatchValue) else None for x in p.patterns]
        return all(type(n) is int and n <= 0 for n in ns) and 0 in ns
    return isinstance(p, ast.MatchValue) and _literal(p.value) == 0 and type(_literal(p.value)) is int


def _rank_aliases(tree: ast.Module) -> frozenset[str]:
    """Names assigned a rank under another name: ``self.gpu_id = int(os.environ["LOCAL_RANK"])``,
    ``if (r := dist.get_rank()) == 0:``."""
    out = set()
    for n in walk(tree):
        if isinstance(n, ast.NamedExpr) and _mentions_rank(n.value):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and _mentions_rank(n.value):
            t = n.targets[0]
            if isinstance(t, (ast.Name, ast.Attribute)):
                out.add(t.id if isinstance(t, ast.Name) else t.attr)
    return frozenset(out)


def _rank_flags(tree: ast.Module, aliases: frozenset[str]) -> frozenset[str]:
    """Names assigned a rank-0 test (torchtune: ``self._is_rank_zero = self.rank == 0``), for ``single_rank``."""
    out = set()
    for n in walk(tree):
        if not (isinstance(n, ast.NamedExpr) or isinstance(n, ast.Assign) and len(n.targets) == 1):
            continue
        t = n.target if isinstance(n, ast.NamedExpr) else n.targets[0]  # `if (is_main := rank == 0):`
        if isinstance(t, (ast.Name, ast.Attribute)) and isinstance(n.value, (ast.Compare, ast.BoolOp, ast.UnaryOp)) \
                and _rank_zero(n.value, aliases) is True:
            out.add(t.id if isinstance(t, ast.Name) else t.attr)
    return frozenset(out)


def _rank_zero(test: ast.expr, aliases: frozenset[str] = frozenset(), flags: frozenset[str] = frozenset()) -> bool | None:
    """True if ``test`` holds on rank 0 only (``rank == 0``, ``not rank``, ``is_main_process``), False if
    it fails on rank 0 only (``rank != 0``, ``rank > 0``, ``not is_main_process``), else None."""
    if isinstance(test, ast.NamedExpr):  # `if (is_main := rank == 0):`
        return _rank_zero(test.value, aliases, flags)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _rank_zero(test.operand, aliases, flags)
        return (not inner) if inner is not None else (True if _mentions_rank(test.operand, aliases) else None)
    if isinstance(test, ast.BoolOp):
        parts = [_rank_zero(v, aliases, flags) for v in test.values]
        if isinstance(test.op, ast.And):
            return True if True in parts else None  # `rank == 0 and ...`
        if True in parts:  # `not dist.is_initialized() or rank == 0`: rank 0 only; Megatron's `... or
            return None if any(p is None and not _one_process(v, aliases)  # ckpt_type != LEGACY or dp_rank == 0`:
                               for v, p in zip(test.values, parts)) else True  # every rank, in another mode
        return False if False in parts else None  # `rank != 0 or ...`: its else is rank 0's
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            return None
        (op,), left, right = test.ops, test.left, test.comparators[0]
        if isinstance(left, ast.Constant):  # `0 == rank`, `0 < rank`: the rank on the left
            left, right, op = right, left, _FLIP.get(type(op), op)
        left = left.value if isinstance(left, ast.NamedExpr) else left  # `(r := dist.get_rank()) == 0`
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



def _one_process(x: ast.expr, aliases: frozenset[str]) -> bool:
    """``_rank_zero``: whether ``x`` holds only when there is a single process, so ``x or rank == 0``
    is still a rank-0 test: ``not dist.is_initialized()``, ``not args.distributed`` (``ddp``,
    ``multiprocessing_distributed``), ``not dist.is_available()``, ``not is_dist_avail_and_initialized()``
    (DETR's, MAE's utils), a world size of 1, ``args.local_rank == -1``."""
    if isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.Not):
        f = x.operand.func if isinstance(x.operand, ast.Call) else x.operand
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name == "is_available":  # torch.distributed's, not torch.cuda's: a CPU run may have many ranks
            return isinstance(f, ast.Attribute) and "dist" in ast.unparse(f.value).lower()
        return re.search(r"distributed|is_initialized|dist_avail|(^|_)ddp($|_)", name.lower()) is not None
    if not (isinstance(x, ast.Compare) and len(x.ops) == 1 and type(n := _literal(x.comparators[0])) is int):
        return False
    op, left = x.ops[0], x.left.func if isinstance(x.left, ast.Call) else x.left
    name = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else ""
    low = name.lower()  # world_size, get_world_size, and a name holding it: world, n_world, ws, nprocs, num_processes
    if "world" in low and "rank" not in low or low in ("ws", "nprocs", "num_processes", "n_procs"):
        return isinstance(op, ast.Eq) and n == 1 or isinstance(op, ast.LtE) and n == 1 or isinstance(op, ast.Lt) and n == 2
    return _mentions_rank(x.left, aliases) and isinstance(op, ast.Eq) and n == -1


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
