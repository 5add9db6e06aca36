"""The steps a ``CheckpointManager`` committed itself (``mgr._own``), in bounded memory.

Every rank keeps one (``CheckpointManager``): ``add`` after each commit, ``roll_back`` in
``restore``, ``check_save`` at each save; rank 0's retention (``retention.py``) asks ``in`` and
``unknown`` of the steps it finds in the run directory. A plain set grew by one step per save for
the whole run (78 bytes a save: some 10,000 entries a week saving every minute). Only the newest
``KEEP`` to ``2 * KEEP`` steps are remembered; every step at or below ``floor`` is forgotten.
Every rank adds the same steps in the same order, so every rank forgets the same ones (the
overwrite and refusal decisions of a save stay the same on all ranks). A forgotten step is never
taken for another run's: retention neither deletes nor sets aside a step at or below ``floor``
as abandoned (``unknown``). A save behind the newest remembered step is refused (``check_save``).
"""

from __future__ import annotations

from .errors import CheckpointError

KEEP = 512  # steps remembered at least; at most twice as many


class OwnSteps:
    """The committed steps of one manager: exact above ``floor``, forgotten at or below it."""

    __slots__ = ("_steps", "floor")

    def __init__(self) -> None:
        self._steps: set[int] = set()
        self.floor: int | None = None  # every step <= floor is forgotten (it may or may not be this manager's)

    def __contains__(self, step: object) -> bool:
        return step in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int) -> None:
        """Every rank, after the save of ``step`` committed (``CheckpointManager._finish_pending``)."""
        self._steps.add(step)
        if len(self._steps) >= 2 * KEEP:  # amortized: a sort every KEEP saves
            ordered = sorted(self._steps)
            cut = ordered[len(ordered) - KEEP - 1]
            self._steps = set(ordered[len(ordered) - KEEP:])
            self.floor = cut if self.floor is None else max(self.floor, cut)

    def roll_back(self, step: int) -> None:
        """Every rank, in ``restore`` that returned ``step``: the steps saved after it are abandoned."""
        self._steps = {s for s in self._steps if s <= step}
        if self.floor is not None and self.floor > step:
            self.floor = step  # the forgotten steps above it are abandoned: known not to be kept as own

    def unknown(self, step: int) -> bool:
        """Rank 0's retention: ``step`` is forgotten (it may be this manager's): never treated as another run's."""
        return self.floor is not None and step <= self.floor and step not in self._steps

    def check_save(self, step: int, restored: int | None) -> None:
        """Every rank, in ``CheckpointManager._save_now`` before anything is written (the same on every
        rank): a save behind this manager's newest committed step is refused (a restart resumes from
        the newest, and would skip it), and after a ``restore`` that returned ``restored``, a save
        older than it. A rollback on purpose goes through ``restore(state, step=...)`` (``roll_back``)."""
        newest = max(self._steps, default=None)
        if newest is not None and step < newest:
            raise CheckpointError(
                f"save(step={step}): this manager saved step {newest} already; the steps given to save() must grow: "
                f"a restart resumes from the newest checkpoint, step {newest}, and would skip what this save holds. "
                "Pass the global training step (not a step within the epoch); to roll back on purpose, call "
                "mgr.restore(state, step=...) first"
            )
        if restored is not None and step < restored and step not in self._steps:
            raise CheckpointError(
                f"save(step={step}): restore() resumed this run from step {restored}; saving an older step would "
                "replace checkpoints and remove the newer ones. Continue the loop from the restored step "
                "(start = mgr.restore(state) or 0), or roll back on purpose with mgr.restore(state, step=...)"
            )
