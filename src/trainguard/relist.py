"""The committed steps of a run directory that a running job's retention deletes from while they
are listed (``CheckpointManager.latest_step``). Any process, no lock, no collective."""

from __future__ import annotations

from .commit import list_steps
from .storage import Storage

_RELISTS = 3  # how many times more a run directory is listed when its newest listed step had no manifest


def committed_steps(storage: Storage, root: str) -> list[int]:
    """The committed steps under run directory ``root``, oldest first (``retention.newest_step``).

    ``list_steps`` lists the step directories, then looks for each one's manifest: a job saving with
    ``KeepLatest(2)`` faster than that can delete every listed step in between (it removes the
    manifest first), and ``latest_step()`` answered None on a live run with checkpoints. When the
    newest listed step has no manifest, the directory is listed again (up to ``_RELISTS`` times) until
    the listing ends in a committed step or stays the same (a crashed save's debris: the answer)."""
    listed = list_steps(storage, root)
    for _ in range(_RELISTS):
        if not listed or listed[-1].status == "committed":
            break
        again = list_steps(storage, root)
        if [(s.name, s.status) for s in again] == [(s.name, s.status) for s in listed]:
            break
        listed = again
    return [s.step for s in listed if s.status == "committed"]
