"""``CheckpointManager.save``: warn, at the save, when a checkpoint leaves out an entry that an
earlier save of the same manager held (a last save of the weights alone, a state built in a branch
that forgot one). A resume finds out too, but only after the crash: ``restore()`` of a state with
that entry refuses the newest checkpoint (strict) and names the older step that holds it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class DroppedEntryWarning(UserWarning):
    """A manager's save lacks an entry that one of its earlier saves held (given once per drop)."""


def check(mgr: Any, state: Mapping[str, Any], step: int) -> None:
    """``CheckpointManager.save`` on every rank, for each step it saves, before the save: remember
    which step last held each entry, and warn (rank 0; with ``split_state`` every rank, whose states
    differ by design) of the entries the previous saves held and this one lacks. An entry that
    comes back and is dropped again is warned of again; one that is added is not warned of."""
    held: dict[str, int] = mgr.__dict__.setdefault("_entries_held", {})
    gone = {key: last for key, last in held.items() if key not in state}
    for key in state:
        held[key] = step
    for key in gone:
        del held[key]
    if gone and (mgr.ctx.rank == 0 or mgr.split_state):
        names = ", ".join(f"{key!r} (last saved at step {last})" for key, last in sorted(gone.items()))
        warnings.warn(
            f"trainguard: the save of step {step} in {mgr.root} has no entry {names}, which this manager's earlier "
            "saves held: restore() of a state with it refuses this checkpoint (strict=True) and names the step that "
            "holds it. Pass the same entries to every save; if it was left out on purpose, this warning is given once",
            DroppedEntryWarning, stacklevel=4)
