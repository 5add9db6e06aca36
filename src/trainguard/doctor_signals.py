"""The doctor's "stop signals" check (``doctor.check`` and ``doctor_source.check_source`` call it,
on the script's source): DataLoader workers and a preemption save.

Slurm (preemption, ``scancel``) signals every process of the job step, Ctrl-C every process of
the terminal's group. torch's DataLoader workers die of a SIGTERM their parent did not send, and
the training process then raises ``DataLoader worker ... is killed by signal`` before its
``CheckpointManager`` reaches the preemption save (docs/data.md, "Stop signals and DataLoader
workers"). ``worker_init_fn=tg.ignore_stop_signals`` keeps them alive until the loader stops them.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .doctor import Finding, Settings


def _workers(call: ast.Call, tree: ast.Module) -> bool:
    """Whether a ``DataLoader(...)`` call may start worker processes: a ``num_workers`` (keyword,
    6th positional, or a key of a ``**kw`` the script builds) that is not a literal 0."""
    from .doctor_source import _dict_keys

    if len(call.args) >= 6:
        v = call.args[5]
    else:
        v = next((k.value for k in call.keywords if k.arg == "num_workers"), None)
    if v is None:
        return any(k.arg is None and "num_workers" in (_dict_keys(tree, k.value) or ()) for k in call.keywords)
    return not isinstance(v, ast.Constant) or bool(v.value)


def worker_signals(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning when the script opens a ``CheckpointManager`` (whose signal handling makes the
    preemption save; not one with ``handle_signals=False``) and builds a ``DataLoader`` that may start workers, and nowhere mentions
    ``ignore_stop_signals``. Not reported without source, manager or such a loader."""
    from .doctor import Finding
    from .doctor_source import _calls, _tree

    if (tree := _tree(s)) is None or "CheckpointManager" not in (s.source or ""):
        return None
    if any(k.arg == "handle_signals" and isinstance(k.value, ast.Constant) and k.value.value is False
           for c in _calls(None, {"CheckpointManager"}, tree) for k in c.keywords):
        return None  # no preemption save to protect
    loaders = [c for c in _calls(None, {"DataLoader"}, tree) if _workers(c, tree)]
    if not loaders:
        return None
    if "ignore_stop_signals" in (s.source or ""):
        return Finding("stop signals", "ok", "DataLoader workers ignore a stop signal sent to the whole process group")
    lines = ", ".join(str(c.lineno) for c in loaders)
    return Finding("stop signals", "warning", f"DataLoader with worker processes (line {lines}): a SIGTERM sent to the "
                   "whole process group (Slurm's preemption and scancel, Ctrl-C for SIGINT) kills its workers, and the "
                   "training process fails ('DataLoader worker ... is killed by signal') before the manager's "
                   "preemption save", "DataLoader(..., worker_init_fn=tg.ignore_stop_signals), or call "
                   "tg.ignore_stop_signals() in your worker_init_fn (docs/data.md)")
