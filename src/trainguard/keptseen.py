"""Which committed checkpoints retention looks at (``retention.retain``, rank 0, holding the run directory's lock).

``committed`` lists the run directory's step directories, trusting the names it saw holding a manifest at the last
retention (``commit.list_steps(known=...)``: no stat, on an object store no HEAD, per kept checkpoint per save).
``kept_gone`` is the check that trust needs before anything is deleted: a step kept in place of an older one must
still hold its manifest. Before, a kept checkpoint whose manifest went after a retention saw it (deleted by hand or
by another process's cleanup, a lifecycle rule) was counted as one of ``KeepLatest(n)``'s n, and the older good
one was deleted: KeepLatest(2) left one valid checkpoint (on object stores since store53, on local disk before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import layout
from .commit import list_steps

if TYPE_CHECKING:
    from .manager import CheckpointManager


def committed(mgr: CheckpointManager) -> list[Any]:
    """``retain``: the run directory's committed checkpoints (``list_steps``), oldest first. A step directory's
    manifest is stat'ed the first time a retention lists it, not at each: ``mgr``'s ``_seen`` holds the names seen
    holding one (dropped once ``_delete`` removes one, when no longer listed, and by ``restore``). Before, every
    save stat'ed each kept checkpoint's: per save O(kept) (KeepAll, 500 kept: 532 os.stat calls a save, now 8).
    ``mgr._trusted``: the names listed as committed without a look this time (``kept_gone`` checks them)."""
    seen = mgr.__dict__.setdefault("_seen", set())
    steps = [s for s in list_steps(mgr.storage, mgr._root, known=seen) if s.status == "committed"]
    mgr._trusted = {s.name for s in steps} & seen  # type: ignore[attr-defined]
    seen.clear()
    seen.update(s.name for s in steps)
    return steps


def kept_gone(mgr: CheckpointManager, steps: list[Any], keep: set[int], newest: int) -> bool:
    """``retain``, before it deletes: whether a step it keeps (``keep``), listed as committed on trust
    (``committed``), no longer holds its manifest. Those are dropped from ``_seen``, so that ``retain``, run
    again, looks at them (listed "incomplete": no place among those kept). Only when a step is to be deleted, and
    only the kept steps that may stand in its place: newer than the oldest step deleted (a policy that reads
    metadata, KeepBest: any), and the newest kept one before ``newest`` (it is the "one before the newest" that
    ``retain`` keeps whatever the policy chose: an older KeepEvery multiple gone, the step it deleted was the only
    valid one before the newest; review54a). A stat (HEAD) each: KeepLatest(n) n-1, KeepEvery(k) one, KeepAll
    none. A failed stat raises (``apply_retention``: nothing deleted)."""
    doomed = [s.step for s in steps if s.step not in keep and s.step < newest]
    if not doomed:
        return False
    trusted, st, low = mgr.__dict__.get("_trusted", set()), mgr.storage, -1 if mgr.keep.reads_metadata else min(doomed)
    before = max((s.step for s in steps if s.step in keep and s.step < newest), default=None)
    gone = [s for s in steps if s.step in keep and s.step != newest and (low < s.step or s.step == before)
            and s.name in trusted and not st.exists(st.join(s.path, layout.MANIFEST))]
    for s in gone:
        mgr._seen.discard(s.name)
    return bool(gone)
