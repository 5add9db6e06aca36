"""Retention on a run directory: which committed checkpoints a ``CheckpointManager`` deletes.

Called by ``CheckpointManager._apply_retention`` on rank 0 only, while it holds the run
directory's lock, after the checkpoint of step ``newest`` is committed (never before): from the
training thread after a sync save, from the save's or the RAM tier's background thread otherwise.
The policy (``policies.RetentionPolicy.select``) decides; this module lists and deletes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .commit import list_steps, read_manifest
from .errors import CheckpointError
from .faults import fault
from .policies import CheckpointInfo

if TYPE_CHECKING:
    from .manager import CheckpointManager


def retain(mgr: CheckpointManager, newest: int) -> None:
    """Delete the committed checkpoints of ``mgr``'s root that ``mgr.keep`` does not keep, older
    than ``newest`` (which is kept whatever the policy says). A step ``restore`` found unusable
    takes no place among those kept."""
    steps = [s for s in list_steps(mgr.storage, mgr._root) if s.status == "committed"]
    infos = [CheckpointInfo(s.step, 0.0, _metrics_of(mgr, s)) for s in steps if s.step not in mgr._rejected]
    keep = set(mgr.keep.select(infos)) | {newest}
    fault("before_retention", mgr.ctx.rank)
    for s in steps:
        if s.step not in keep and s.step < newest:
            mgr.storage.remove_tree(s.path)
            mgr._metrics.pop(s.step, None)
            mgr.events.emit("retention_delete", step=s.step)


def _metrics_of(mgr: CheckpointManager, s: Any) -> dict[str, float]:
    """The metrics saved with step ``s`` (cached in ``mgr._metrics``; read from its manifest once)."""
    if s.step not in mgr._metrics:
        try:
            mgr._metrics[s.step] = dict(read_manifest(mgr.storage, s.path).metadata.get("metrics", {}))
        except CheckpointError:
            mgr._metrics[s.step] = {}
    return mgr._metrics[s.step]
