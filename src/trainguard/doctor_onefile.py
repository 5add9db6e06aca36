"""The doctor's "one file, every rank" check (``doctor_source.source_checks`` runs it on the script's
source): a ``torch.save(obj, path)`` that every rank of a distributed script reaches, to a path
that names no rank. Every rank then writes the same file at once: each ``open`` truncates what
the others wrote, a reader between two writers finds a torn file, and where the ranks hold
different tensors (FSDP shards, ZeRO partitions, per-rank RNG) the file ends up mixed. A save
under a rank-0 condition (``if rank == 0:``, ``if not is_main_process: return`` before it, a
``@rank_zero_only`` function, a function of the script only called there) or to a per-rank path
(``f"ckpt-{rank}.pt"``) is fine. The tests that hold on rank 0 only are ``doctor_rank``'s.
Static, on the script's text only: any rank, no I/O.
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_DISTRIBUTED = {"init_process_group", "DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP",
                "fully_shard", "init_device_mesh"}


def _distributed(tree: ast.Module) -> bool:
    from .doctor_source import _callee

    return any(isinstance(n, ast.Call) and _callee(n) in _DISTRIBUTED for n in walk(tree))


def _guarded(tree: ast.Module) -> set[int]:
    """Ids of the nodes only rank 0 runs: the branches of rank-0 tests, what follows an exit of the
    other ranks, ``rank_zero`` functions, and the functions of the script called only from those."""
    from .doctor_rank import _rank_aliases, _rank_flags, _rank_zero
    from .doctor_source import _receiver

    aliases = _rank_aliases(tree)
    flags = _rank_flags(tree, aliases)
    blocks: list[list[ast.stmt]] = []
    for node in walk(tree):
        zero = _rank_zero(node.test, aliases, flags) if isinstance(node, ast.If) else None
        if isinstance(node, ast.If) and (zero is not None or (zero := _first_device(node.test)) is not None):
            blocks.append(node.body if zero else node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "rank_zero" in ast.unparse(d) for d in node.decorator_list):
            blocks.append(node.body)
        for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            for i, st in enumerate(block if isinstance(block, list) else []):  # `if rank != 0: return`, then the rest
                if isinstance(st, ast.If) and not st.orelse and st.body and isinstance(
                        st.body[-1], (ast.Return, ast.Continue, ast.Break, ast.Raise)) and _rank_zero(
                        st.test, aliases, flags) is False:
                    blocks.append(block[i + 1:])
                    break
    ids = {id(x) for b in blocks for st in b for x in ast.walk(st)}
    funcs = [n for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for _ in range(3):  # helpers of helpers: pytorch/examples' `if self.gpu_id == 0: self._save_snapshot(epoch)`
        calls = [c for c in walk(tree) if isinstance(c, ast.Call) and _receiver(c) in (None, "self", "cls")]
        for f in funcs:
            mine = [c for c in calls if _name(c) == f.name]
            if mine and all(id(c) in ids for c in mine):
                ids |= {id(x) for x in ast.walk(f)}
    return ids


_DEVICE = re.compile(r"(^|_)(gpu|gpu_id|device_id|proc|proc_id|process_id|worker_id)($|_)")


def _first_device(test: ast.expr) -> bool | None:
    """True for a test that holds on the process of the first GPU only, which a script spawned
    per GPU uses as its rank (pytorch/examples' multigpu.py: ``if self.gpu_id == 0 and ...:``);
    None otherwise. Read only here: a save under it is no save of every rank."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    for t in parts:
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
            continue
        n, left = t.comparators[0], t.left
        name = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else ""
        if isinstance(n, ast.Constant) and type(n.value) is int and n.value == 0 and _DEVICE.search(name.lower()):
            return True
    return None


def _name(c: ast.Call) -> str:
    from .doctor_source import _callee

    return _callee(c)


def _per_rank(path: ast.expr | None, tree: ast.Module) -> bool:
    """Whether the path names a rank (``f"ckpt-{rank}.pt"``, a name assigned one, a file opened at one)."""
    from .doctor_rank import _mentions_rank, _rank_aliases

    aliases = _rank_aliases(tree)

    def names_rank(x: ast.AST) -> bool:
        return any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) and _mentions_rank(n, aliases)
                   for n in ast.walk(x))
    if path is None or names_rank(path):
        return True
    if isinstance(path, ast.Name):  # `ckpt = f"...{rank}"`, `with open(f"...{rank}", "wb") as f:`
        for n in walk(tree):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == path.id for t in n.targets):
                if names_rank(n.value):
                    return True
            elif isinstance(n, ast.withitem) and isinstance(n.optional_vars, ast.Name) and \
                    n.optional_vars.id == path.id and names_rank(n.context_expr):
                return True
    return False


def one_file(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for each ``torch.save`` every rank of a distributed script makes to one path;
    ``None`` without source, or for a script that starts no process group."""
    from .doctor import Finding
    from .doctor_source import _receiver, _tree

    if (tree := _tree(s)) is None or not _distributed(tree):
        return None
    guarded = _guarded(tree)
    hits = [c for c in walk(tree) if isinstance(c, ast.Call) and _name(c) == "save" and _receiver(c) == "torch"
            and id(c) not in guarded and not _per_rank(c.args[1] if len(c.args) > 1 else next(
                (k.value for k in c.keywords if k.arg == "f"), None), tree)]
    if not hits:
        return Finding("one file, every rank", "ok", "no torch.save that every rank makes to one path")
    c = min(hits, key=lambda h: h.lineno)
    return Finding("one file, every rank", "warning", f"line {c.lineno}: {ast.unparse(c)} runs on every rank of this "
                   "distributed script, all to the same file: each rank truncates and rewrites it while the others "
                   "write (a reader between two finds a torn file), and ranks that hold different tensors (FSDP "
                   "shards, optimizer partitions, RNG) leave a mixed one",
                   "guard it (if dist.get_rank() == 0: torch.save(...)) to export replicated weights, or checkpoint "
                   "with mgr.save(step, state) on every rank: each rank writes its own part, one commit")
