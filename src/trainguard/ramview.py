"""What a process that only reads finds of a run's RAM tier (``tiers.RamTier``), without torch:
where it is (:func:`ram_dir`), whether it holds this run's copies (:func:`ram_copies`) and which of
them a restore discards (:func:`stale_reason`). ``trainguard ls``/``verify`` call these; so does
``RamTier`` (:mod:`.tiers` re-exports every name here).
"""

from __future__ import annotations

import hashlib
import os

from . import layout
from .errors import CheckpointError
from .manifest import MAX_MANIFEST_BYTES, verified_body
from .ramleft import found_dir
from .storage import LocalStorage, Storage, location

DEFAULT_BASE = layout.RAM_BASE
RUN_ID = ".trainguard-run-id"  # in the durable root and in its RAM tier: which run they belong to
ON_DISK = ".trainguard-on-disk"  # in the RAM tier: the RAM copy last found or copied on disk (name, manifest hash)


def ram_dir(root: str, base: str = DEFAULT_BASE) -> str:
    """Where the RAM tier of the run ``root`` lives (the same for every restart of the job, whatever link leads to ``root``)."""
    # os.fsencode: a non-UTF-8 name (surrogate-escaped) has a key too; the same bytes as .encode() for UTF-8 names
    key = hashlib.sha1(os.fsencode(os.path.realpath(root)) if "://" not in root else root.encode()).hexdigest()[:16]
    return os.path.join(base, f"trainguard-ram-{os.getuid()}", key)


def ram_copies(root: str, base: str = DEFAULT_BASE) -> str | None:
    """``trainguard ls``: the RAM tier directory of run ``root`` on this node, under ``base`` (the
    manager's ``ram_tier=``), when it holds checkpoints the next manager would use: it carries
    the run directory's ``RUN_ID`` (else ``RamTier._check_run`` discards it at open). None if not."""
    from .storage import for_path

    storage, r = for_path(root)
    here = found_dir(location(storage, r), base)  # an older version's name for it too (ramleft.py)
    mine, marker = os.path.join(here, RUN_ID), storage.join(r, RUN_ID)
    if not os.path.isfile(mine) or not storage.exists(marker):
        return None
    with open(mine, "rb") as f:
        return here if f.read(64) == storage.read_bytes(marker, 64) else None


def on_disk_mark(ram: str, step: int) -> bytes:
    """``ON_DISK``'s content for the RAM copy of ``step`` in the RAM tier ``ram``: its name and
    its manifest's hash (a later RAM copy of the same step, saved after a rollback, differs)."""
    name = layout.step_dir(step)
    raw = LocalStorage().read_bytes(os.path.join(ram, name, layout.MANIFEST), MAX_MANIFEST_BYTES)
    return f"{name} {hashlib.sha1(raw).hexdigest()}".encode()


def stale_reason(ram: str, durable: Storage, durable_root: str, step: int, on_disk: bool) -> str:
    """Why the RAM copy of ``step`` in the RAM tier ``ram`` is another timeline's, or ``""``.
    ``RamTier.candidates`` discards such a copy; ``trainguard ls``/``verify`` do not offer it.
    It is when the run directory holds ``step`` (``on_disk``) with another manifest (written since
    by a run on another node: the copy to disk never replaces a step, so both are the same bytes
    otherwise), or no longer holds it though it reached disk (``ON_DISK``): a run elsewhere went
    back behind it (``restore(step=N)``, retention of the abandoned timeline) or the user deleted
    it. Before, the RAM copy was restored over the run directory's checkpoints: a rollback done
    on another node was undone when the job came back to this one. ``""`` when unreadable, or
    when the run directory's manifest is corrupt (the RAM copy is then the good one)."""
    name, local = layout.step_dir(step), LocalStorage()
    try:
        if on_disk:
            mine = local.read_bytes(os.path.join(ram, name, layout.MANIFEST), MAX_MANIFEST_BYTES)
            theirs = durable.read_bytes(durable.join(durable_root, name, layout.MANIFEST), MAX_MANIFEST_BYTES)
            if mine != theirs:
                verified_body(theirs)  # a manifest corrupt on disk is no other run's checkpoint: raises, ""
            return "the run directory holds another checkpoint of that step" if mine != theirs else ""
        marker = os.path.join(ram, ON_DISK)
        gone = os.path.exists(marker) and local.read_bytes(marker, 128) == on_disk_mark(ram, step)
        return "it reached the run directory and was removed from it since" if gone else ""
    except (OSError, CheckpointError):  # unreadable: restore tries it and says why
        return ""
