"""Which run wrote a checkpoint: the run directory's id in each manifest a manager writes, compared at restore.

A step directory copied in from another run (``cp -r ../exp-a/step-000000700 ckpts/exp-b/``) verified and was
restored without a word: nothing in a manifest said which run wrote it. Fine-tuning from a copied checkpoint is
legitimate; resuming the wrong experiment silently is not. So:

- ``run_id`` (rank 0, at the manager's first save or restore, so after the RAM tier's open, whose check of the
  run may write it first): the run directory's id, the ``.trainguard-run-id`` file the RAM tier already keeps there
  (``tiers.RamTier._check_run``), written with a new random id when absent (one small write per run directory,
  once; one read per manager after that);
- ``run_meta`` (``CheckpointManager._save_now``, every rank; rank 0's metadata is the one written): ``{"run": {"id",
  "dir"}}`` in the manifest's metadata. Readers that predate it ignore the key (metadata is free-form);
- ``run_restored`` (``CheckpointManager.restore``, rank 0, after a step loaded): when that step's manifest names
  another id, a warning naming the run directory that wrote it, and ``foreign_run`` in the ``restore`` event.
  Checkpoints without the key (saved before it, or by ``tg.save``) are restored as before, without a word.

A whole run directory copied (``cp -r run1 run2``) carries its id file: ``run2`` continues ``run1``, no warning.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from .errors import CheckpointError, is_store_client_error
from .ramview import RUN_ID
from .storage import location

log = logging.getLogger("trainguard")
KEY = "run"  # in a manifest's metadata: {"id": the run directory's id, "dir": where it was (absolute path, or URL)}


def run_id(mgr: Any) -> str:
    """``run_meta`` and ``run_restored`` on rank 0, holding the lock ("" on other ranks: their metadata is not written);
    read once per ``open`` (``CheckpointManager.open`` forgets it: a manager opened again after its directory was
    removed to start over kept the deleted run's id, which its saves carried, and the next job, finding the new
    id file, warned that its own steps came from another run; review58g). An id file that cannot be read or written (a medium's error, an object store's: an
    ``OSError``, a ``CheckpointError`` of the storage layer, or a client library's own exception such as botocore's
    ``EndpointConnectionError``, which is no ``OSError``) leaves the manager without one: its saves then carry no
    id, as before; nothing fails for it. Before (review58g), a store client's exception escaped: a ``restore`` that
    had loaded its step raised it, and the first ``save`` raised it past ``on_error``."""
    if mgr.ctx.rank != 0:
        return ""
    if (rid := mgr.__dict__.get("_run_id")) is not None:
        return rid
    st, marker = mgr.storage, mgr.storage.join(mgr._root, RUN_ID)
    try:
        if st.exists(marker):
            rid = st.read_bytes(marker, 64).decode(errors="replace").strip()
        else:
            rid = uuid.uuid4().hex
            st.write_atomic(marker, rid.encode())
    except Exception as e:  # noqa: BLE001 - see above; anything else is a bug, raised
        if not isinstance(e, (OSError, CheckpointError)) and not is_store_client_error(e):
            raise
        log.warning("trainguard: cannot read or write the run id %s (%s): saves carry none", marker, e)
        rid = ""
    mgr._run_id = rid
    return rid


def run_meta(mgr: Any) -> dict[str, Any]:
    """The manifest metadata naming this run (empty without an id: other ranks, or an id file that failed)."""
    rid = run_id(mgr)
    return {KEY: {"id": rid, "dir": location(mgr.storage, mgr._root)}} if rid else {}


def run_restored(mgr: Any, step: int, path: str, metadata: Any) -> dict[str, Any]:
    """``CheckpointManager.restore`` on every rank once ``step`` loaded from ``path``: the fields for its
    ``restore`` event (``foreign_run``: the run directory that wrote it, when not this run), with a warning on
    rank 0 saying so. Nothing for a checkpoint without an id (older ones, ``tg.save``'s) or of this run."""
    rid = run_id(mgr)
    run = metadata.get(KEY) if isinstance(metadata, dict) else None
    if mgr.ctx.rank != 0 or not rid or not isinstance(run, dict) or not isinstance(run.get("id"), str) or run["id"] == rid:
        return {}
    where = str(run.get("dir", "?"))
    log.warning(
        "trainguard: restored step %d from %s, which another run wrote (run directory %s when saved, run id %s; this "
        "run directory's id is %s): a checkpoint copied in from elsewhere. Fine-tuning from it is fine; if you meant "
        "to resume this run, move that step directory out of %s and start again", step, path, where, run["id"], rid, mgr.root)
    return {"foreign_run": where}
