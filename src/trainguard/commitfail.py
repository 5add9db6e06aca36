"""A save's failed commit, as every rank raises it (``api.persist_and_commit``): rank 0 names a
lost run lock (``runlock.check_owned``) as the cause, and the "commit" round carries whether the
error is permanent, so that every rank's process exits 78 under ``trainguard run`` (permanent.py)."""

from __future__ import annotations

import os
import warnings
from typing import Any, NoReturn

from . import layout
from .errors import CheckpointError, describe_error
from .outtemp import drop_owner, kept_for_writer
from .runlock import check_owned, holder_of
from .samesave import concurrent, drop_failed, remove_own
from .storage import Storage
from .storage._stale import active, drop_incomplete


def discard(storage: Storage, work: str, outcome: dict[str, Any], error: Exception | None,
            written: list[Any] | None = None, manifest: Any = None) -> tuple[dict[str, Any], Exception | None]:
    """``api.persist_and_commit``, rank 0, a save that failed (``outcome``, and ``error``, this
    process's own, raised as itself by a single process): remove its temp directory ``work``; on an
    object store, where ``work`` is the step itself, only the objects its ranks (``written``: their
    reports) created when it met another save of the step (``samesave.remove_own``: the other's stay); when it
    failed otherwise, the step's objects but a manifest it did not write (``manifest``: the one it wrote, if any)
    and what that manifest names (``samesave.drop_failed``: another save of the step committed meanwhile).
    When the run directory's lock was lost meanwhile (``runlock.check_owned``: an ``rm -rf`` while
    the ranks wrote made their writes fail with ENOENT), that error, permanent, replaces both: the
    write's error (not permanent) had ``trainguard run`` restart the job into an empty directory."""
    if not storage.atomic_rename and concurrent(outcome, error):
        remove_own(storage, work, written)
    elif not storage.atomic_rename:
        drop_failed(storage, work, manifest)
    else:
        storage.remove_tree(work)
    try:
        check_owned(os.path.dirname(work.rstrip("/")))
    except CheckpointError as lost:
        return {"error": describe_error(lost), "permanent": True}, lost
    return outcome, error


def discard_late(storage: Storage, work: str, outcome: dict[str, Any], report: dict[str, Any]) -> None:
    """``api.persist_and_commit``, a rank other than 0 that the "commit" round's ``outcome`` names among the failed
    ones (maybe late: it (re)created the temp directory after rank 0's ``discard`` removed it): remove ``work``. Not
    on an object store when the save met another save of its step (``samesave.concurrent``): there ``work`` is the
    step itself and holds the other save's objects: only this rank's own (``report``: its "written" report, whose
    objects a late rank created after rank 0's ``discard`` removed the others' own; ``samesave.remove_own``).
    Before (review55g), such a rank removed the whole step, manifest first, after the commit round: a 2-rank save
    that lost to another save of the step deleted the winner's committed checkpoint (whose save had returned).
    Otherwise on an object store ``samesave.drop_failed``: not a manifest (rank 0 wrote none: the save failed), nor
    what it names (review56a: ``remove_tree`` deleted a checkpoint another save of the step committed meanwhile)."""
    if storage.atomic_rename:
        storage.remove_tree(work)
    elif not concurrent(outcome, None):
        drop_failed(storage, work)
    else:
        remove_own(storage, work, [report])


def check_commit(target: str, outcome: dict[str, Any]) -> None:
    """``api.persist_and_commit``, every rank, on the "commit" round's ``outcome``: raise rank 0's
    failed commit (its error as text), permanent when rank 0's error was (``runlock.check_owned``)."""
    if outcome.get("error"):
        err = CheckpointError(f"save of {target} failed at commit on rank 0:\n{outcome['error']}")
        err.permanent = bool(outcome.get("permanent"))
        raise err


def discard_copy(storage: Storage, work: str, root: str, e: BaseException) -> NoReturn:
    """``tiers.RamTier.persist`` (rank 0's background copy of a step to the run directory ``root``)
    that failed with ``e``: remove its temp directory ``work``, then raise the lost run lock's
    error (an ``rm -rf`` of ``root`` mid-copy made the copy fail with ENOENT) in place of ``e``,
    else ``e``. Its error is raised by the manager's ``close`` (``RamTier.close``)."""
    storage.remove_tree(work)
    if isinstance(e, Exception):  # not a Ctrl-C
        check_owned(root)
    raise e


def renamed_anyway(storage: Storage, work: str, final: str, error: BaseException) -> None:
    """``commit.commit_dir``, rank 0, when renaming ``work`` to ``final`` raised ``error``: raise it,
    unless the rename itself happened and only the sync of the parent directory after it failed.
    The checkpoint is then committed (every file of it fsynced, visible, loadable): warn that a
    power loss may undo the rename (a restart then resumes from the previous checkpoint, as after
    a save that failed) and return. Before, the save was reported failed while a restart loaded it."""
    if not isinstance(error, OSError):
        raise error
    try:
        renamed = not storage.exists(work) and storage.exists(storage.join(final, layout.MANIFEST))
    except OSError:
        renamed = False
    if not renamed:
        raise error
    warnings.warn(f"{final} is committed, but syncing its parent directory after the rename failed ({error}): a power "
                  "loss may undo the commit, and a restart then resumes from the previous checkpoint", stacklevel=3)


def removed(storage: Storage, path: str, name: str) -> list[str]:
    """``commit.clean_debris``: remove the debris ``path``; ``[name]`` when it is gone, ``[]`` when part of
    it stays (``remove_tree`` warned why: a refused or busy entry; an object store's 403 or outage). Before, the
    open's warning and ``debris`` event listed such a directory as removed, open after open (on object stores
    until hunt53: a read-only key's open said "removed debris ... ['step-000000005']", which stayed).
    On S3, a directory written to within the idle limit is left (``_stale.active``: maybe a live save's, another
    process's; ``_stale.recheck`` looks again): ``[]``. On an object store the objects of one listing go, not a
    manifest (``_stale.drop_incomplete``: a save that committed the step since ``list_steps`` listed it keeps it).
    On local disk, a temp directory whose ``consolidate``/``convert`` writer is alive (``outtemp.kept_for_writer``: its
    owner file's lock; that writer takes no run lock) is left: ``[]``; a dead one's owner file goes with it."""
    if active(storage, path) or storage.atomic_rename and kept_for_writer(path):  # a consolidate's: its owner lives
        return []
    if not storage.atomic_rename and hasattr(storage, "objects") and layout.parse_step(name) is not None:
        # a step directory without a manifest, as listed: one that appeared since stays
        return [name] if drop_incomplete(storage, path) else []
    storage.remove_tree(path)
    if storage.atomic_rename:
        if os.path.lexists(path):
            return []
        drop_owner(path)
        return [name]
    try:
        return [] if storage.listdir(path) else [name]  # objects left (not exists(): SeaweedFS keeps a folder entry)
    except OSError:
        return []


def mount_point(storage: Storage, final: str) -> dict[str, str]:
    """``commit.occupied`` (rank 0, before a save): a refusal when ``final`` is a mount point (local storage),
    else ``{}``. A save writes ``<final>.tmp-<id>`` beside it, on the file system that holds the mount point
    (a container's root, maybe small or ephemeral), then renames it into place, which a mount point cannot be:
    ``tg.save("/ckpt", state)`` with a volume mounted at ``/ckpt`` wrote the whole checkpoint there and
    then failed with "Device or resource busy"."""
    if not storage.atomic_rename or not os.path.ismount(final):
        return {}
    return {"refused": (
        f"{final} is a mount point: a checkpoint is a directory that the save writes beside it and renames into "
        f"place, and a mount point cannot be replaced. Save into a directory inside it ({os.path.join(final, 'ckpt')}), "
        "or pass it to a CheckpointManager as its run directory")}


def unsafe_target(storage: Storage, final: str, above: bool) -> dict[str, str]:
    """``commit.occupied`` (rank 0, before a save): a refusal when ``final`` is a mount point
    (:func:`mount_point`), or, for a save not made by a manager (``above``), lies inside a committed
    checkpoint (``layout.inside_checkpoint``) or is a step directory of a run that a live
    ``CheckpointManager`` holds (``runlock.holder_of``: its retention deletes that directory, its own
    save of that step replaces it; ``tg.save("run/step-000000100", state, overwrite=True)`` replaced
    a live run's checkpoint behind its lock). Else ``{}``."""
    if refused := mount_point(storage, final) or above and layout.inside_checkpoint(storage, final):
        return refused
    root, name = os.path.split(final.rstrip("/"))
    if not above or not storage.atomic_rename or layout.parse_step(name) is None or not (holder := holder_of(root)):
        return {}
    return {"refused": (
        f"{final} is a step directory of the run {root}, which a CheckpointManager holds ({holder}): its retention "
        "deletes such directories and its own save of that step replaces it. Save through that manager "
        "(mgr.save(step, state, force=True)), or to a path outside its run directory")}


def under_a_file(storage: Storage, final: str) -> dict[str, str]:
    """``commit.occupied``, rank 0, when listing ``final`` said "not a directory": the refusal,
    naming the file that is in the way, ``final`` itself or the nearest existing ancestor
    (``consolidate ck afile/sub`` named ``afile/sub`` before, which does not exist)."""
    path = final.rstrip("/") or final
    while not storage.exists(path):
        parent = os.path.dirname(path)
        if parent in ("", path) or parent.endswith(":/"):
            path = final
            break
        path = parent
    where = "" if path == final else f" (the checkpoint's path {final} is under it)"
    return {"refused": f"{path} is a file, not a directory{where}; save the checkpoint to a directory path"}


def wrong_size(storage: Storage, path: str, have: int, want: int) -> str:
    """What a data file of the wrong size is, for ``commit.check_file_sizes`` and ``inspect``'s
    ``verify`` and ``list_checkpoints`` (a lookup, on that failure only): a directory standing in
    for the file read as "4096 bytes" before. An object store lists a file as no names, without an
    error (a directory there holds objects): a truncated object read as "a directory" (ed7628d).
    A symbolic link in a local checkpoint (``cp -rs``, DVC or git-annex put one in place of the file)
    is said to be one: its own size read as "44 bytes on disk ... (truncated or replaced)" before
    (review57c), where ``tg.load`` of an index that is a link said "is a symbolic link"."""
    link = symlink_to(storage, path)
    if link is not None:
        return (f"a symbolic link (to {link}), not a data file of {want} bytes: checkpoint files must be regular files "
                "inside the checkpoint; if the file it points to is this checkpoint's, put a copy of it in place of the link")
    try:
        names = storage.listdir(path)
    except OSError:
        names = None
    if names is None or not (names or storage.atomic_rename):
        return f"{have} bytes on disk, the manifest says {want} (truncated or replaced)"
    return f"a directory, not a data file of {want} bytes (replaced)"


def symlink_to(storage: Storage, path: str) -> str | None:
    """Where ``path`` points when it is a symbolic link on local storage (``wrong_size``, and
    ``commit.check_file_sizes`` for a link whose target is gone); None otherwise (an object store has none)."""
    from .storage.local import LocalStorage

    if not isinstance(storage, LocalStorage):
        return None
    try:
        return os.readlink(path)
    except OSError:  # not a link (EINVAL), not there, or unreadable: the caller's words stand
        return None
