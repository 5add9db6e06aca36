"""The doctor's checks that read the training script's source (:mod:`trainguard.doctor` runs them).

Static, on the script's text only (``Settings.source``): a save that only rank 0 reaches. Each
check returns ``None`` when there is no source to read.
"""

from __future__ import annotations

import ast
from typing import Any

from .doctor import Finding, Settings, _calls

_SAVE_CALLS = {"save", "save_checkpoint", "async_save"}
_FOREIGN_SAVES = {"np", "numpy", "wandb", "mlflow", "joblib", "pickle", "plt", "json"}  # not checkpoints
_RANK_ZERO_FLAGS = {"is_main_process", "is_rank_zero", "is_master", "master_process", "rank_zero", "is_global_zero"}


def single_rank(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    if s.source is None:
        return None
    try:
        tree = ast.parse(s.source)
    except SyntaxError:
        return None
    calls: list[ast.Call] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_rank_zero(node.test):
            calls += _calls(None, _SAVE_CALLS, ast.Module(body=node.body, type_ignores=[]))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "rank_zero" in ast.unparse(d) for d in node.decorator_list):
            calls += _calls(None, _SAVE_CALLS, node)
    owner = [(c.lineno, _receiver(c)) for c in calls]
    hits = sorted({n for n, r in owner if r not in _FOREIGN_SAVES and r != "torch"})
    if hits:
        return Finding("all ranks save", "error", f"save called under a rank-0 condition (line "
                       f"{', '.join(map(str, hits))}): the other ranks' shards, RNG and data positions are never "
                       "written, and a collective save waits forever for them", "call mgr.save(step, state) on "
                       "every rank; trainguard decides which rank writes what")
    if torch_saves := sorted({n for n, r in owner if r == "torch"}):
        return Finding("all ranks save", "warning", f"torch.save under a rank-0 condition (line "
                       f"{', '.join(map(str, torch_saves))}): fine to export a replicated (DDP) model's weights, "
                       "but as a checkpoint it misses FSDP shards and every other rank's RNG and data position",
                       "checkpoint with mgr.save(step, state) on every rank; keep rank-0 torch.save for exports")
    return Finding("all ranks save", "ok", "no save under a rank-0 condition")


def _receiver(call: ast.Call) -> str | None:
    """``torch`` for ``torch.save(...)``, ``mgr`` for ``self.mgr.save(...)``, None for a bare ``save(...)``."""
    v = getattr(call.func, "value", None)
    return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None


def _is_rank_zero(test: ast.expr) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.Compare) and any(isinstance(o, (ast.Eq, ast.Is)) for o in n.ops):
            sides = [n.left, *n.comparators]
            if any(isinstance(x, ast.Constant) and x.value == 0 for x in sides) and \
                    any("rank" in ast.unparse(x).lower() for x in sides):
                return True
        if isinstance(n, ast.Name) and n.id in _RANK_ZERO_FLAGS:
            return True
        if isinstance(n, ast.Attribute) and n.attr in _RANK_ZERO_FLAGS:
            return True
    return False
