"""A fresh start in a directory whose subdirectory holds a run: the manager pointed one level up.

``CheckpointManager("ckpts")`` where the run was ``CheckpointManager("ckpts/run1")`` (a config's
directory shortened, a launcher that appends the run's name in one script and not in another)
found no checkpoint in ``ckpts``, and ``restore()`` started the run afresh without a word, beside
the run it should have resumed (seen: step 0 again, ``ckpts/run1/step-*`` untouched). A manager
pointed at a checkpoint (one level down) is refused (``manager.open``); one level up cannot be
refused (a directory of runs may hold one more), so :func:`nested_runs` warns, naming the
subdirectories that hold committed checkpoints and their newest step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import layout
from .storage import LocalStorage

log = logging.getLogger("trainguard")
_MAX_LOOKED = 64  # subdirectories looked into at most: a fresh start's listing stays cheap


def nested_runs(mgr: Any) -> None:
    """``retention.restore_candidates`` (rank 0, in ``restore``) when the run directory holds no
    committed checkpoint: log a warning when a subdirectory of it does (local run directories only:
    on an object store each would cost a listing). Never raises."""
    from .commit import list_steps

    if not isinstance(mgr.storage, LocalStorage):
        return
    found: list[tuple[str, int]] = []
    try:
        names = [n for n in mgr.storage.listdir(mgr._root) if not n.startswith(".") and layout.parse_step(n) is None]
    except Exception:  # a hint: an unreadable run directory is no reason to fail the restore
        return
    for name in [n for n in names if os.path.isdir(os.path.join(mgr._root, n))][:_MAX_LOOKED]:  # files not counted
        try:
            steps = [s.step for s in list_steps(mgr.storage, os.path.join(mgr._root, name)) if s.status == "committed"]
        except Exception:  # this one unreadable: the others are still looked into (one stopped them all before)
            continue
        if steps:
            found.append((name, max(steps)))
    if found:
        log.warning(
            "trainguard: %s holds no checkpoint, and restore() starts this run afresh; but its subdirectory %s holds "
            "a run's checkpoints. To resume that run, pass its directory: CheckpointManager(%r)",
            mgr.root, " and ".join(f"{n!r} (newest step {s})" for n, s in found[:5]), os.path.join(mgr.root, found[0][0]),
        )


def older_holds(e: BaseException, candidates: list[tuple[int, str, str]], step: int) -> BaseException:
    """``CheckpointManager.restore`` (every rank, the same candidates): ``e``, the newest checkpoint's
    ``StateMismatchError``, told which older checkpoint holds the whole entries it lacks. A save that left
    an entry out of its state (a last ``mgr.save(step, {"model": model}, force=True)`` of the weights
    alone) made the next restore fail with "Pass strict=False", which starts the optimizer afresh
    while the checkpoint before held it. Reads at most 8 older manifests; ``e`` unchanged otherwise."""
    from .commit import read_manifest
    from .errors import StateMismatchError
    from .storage import for_path

    whole = [k for k in getattr(e, "missing", ()) if "/" not in k] if isinstance(e, StateMismatchError) else []
    if not whole or not e.args or not isinstance(e.args[0], str):
        return e
    for older, path, _tier in [c for c in candidates if c[0] < step][:8]:
        try:
            held = read_manifest(*for_path(path)).objects
        except Exception:  # unreadable: the next older one
            continue
        if all(k in held for k in whole):
            e.args = (e.args[0] + f" The checkpoint of step {older} holds {', '.join(whole)}: a save since then left "
                      f"{'it' if len(whole) == 1 else 'them'} out of its state (a last save of the weights alone?). To "
                      f"resume with {'it' if len(whole) == 1 else 'them'}, restore that one: mgr.restore(state, "
                      f"step={older}); strict=False here starts {', '.join(whole)} afresh", *e.args[1:])
            break
    return e


def at_or_before(candidates: list[tuple[int, str, str]], at: int | None, root: str) -> list[tuple[int, str, str]]:
    """``CheckpointManager.restore(step=at)``, every rank: the candidates at or before ``at`` (all of them
    for None, or none to choose from). When the run holds checkpoints, all of them newer (retention deleted
    ``at``'s), a ``CheckpointError`` naming the steps it holds: it named none, and the user had to list them."""
    from .errors import CheckpointError

    if at is None or not candidates:
        return candidates
    older = [c for c in candidates if c[0] <= at]
    if not older:
        held = sorted({c[0] for c in candidates})
        shown = ", ".join(map(str, held[:8])) + (f" ... {held[-1]}" if len(held) > 8 else "")
        raise CheckpointError(f"restore(step={at}): {root} holds no checkpoint at or before step {at}; it holds "
                              f"step(s) {shown}: pass one of them, or step=None for the newest")
    return older
