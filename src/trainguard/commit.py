"""The run directory's lifecycle: the writer lock (``runlock``), debris cleanup, discovery of checkpoints.

Called on rank 0 only (the manager broadcasts results); the commit fence between ranks is in
:mod:`.commitfence`. The two-phase commit itself is in ``api.save``: all ranks write and fsync into
the temp directory, report through the store, then rank 0 writes ``manifest.json`` last and renames
the directory. No torch: ``trainguard ls``/``inspect``/``verify`` read checkpoints through this module.
"""

from __future__ import annotations

import errno
import os
import shlex
import warnings
from dataclasses import dataclass
from typing import Any

from . import layout
from .commitfail import removed, renamed_anyway, symlink_to, under_a_file, unsafe_target, wrong_size
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    StepExistsError,
    is_media_error,
)
from .faults import fault
from .manifest import MAX_MANIFEST_BYTES, Manifest, parse
from .runlock import RunLock, check_owned  # noqa: F401  (the manager imports RunLock from here)
from .samesave import check_objects, drop_listed
from .storage import Storage, location
from .storage._stale import abort_under
from .storage._urls import bucket_root

_UNKNOWN_STATS = 8  # list_steps with known names: more step directories not known than this, the flat listing


def read_manifest(storage: Storage, directory: str) -> Manifest:
    """Read and validate ``<directory>/manifest.json``; ``NotACheckpointError`` if it is absent,
    ``CorruptCheckpointError`` if the directory is named ``step-N`` and the manifest is of another
    step (a step directory renamed or copied by hand: a restore would go on from the wrong step)."""
    m = parse(*manifest_bytes(storage, directory))
    named = layout.parse_step(os.path.basename(directory.rstrip("/")))
    if named is not None and named != m.step:
        err = CorruptCheckpointError(
            f"{location(storage, directory)} is named step {named} but holds the checkpoint of step {m.step} (renamed or copied by "
            f"hand?): rename it {layout.step_dir(m.step)}, or to a name that is not a step's", file=layout.MANIFEST)
        err.advice_given = True  # type: ignore[attr-defined]  # the rename is the fix: tg.load names no earlier step
        raise err
    return m


def manifest_bytes(storage: Storage, directory: str) -> tuple[bytes, str]:
    """The bytes of ``<directory>/manifest.json`` and how errors name it; ``NotACheckpointError`` if absent."""
    path = storage.join(directory, layout.MANIFEST)
    if not storage.exists(path):
        if not storage.exists(directory):
            raise NotACheckpointError(f"{location(storage, directory)}: no such checkpoint directory{absent(storage, directory)}")
        raise NotACheckpointError(run_dir_named(storage, directory) or (
            f"{location(storage, directory)} is not a committed checkpoint (no {layout.MANIFEST}); it may be a save that "
            "crashed or is still running. Pick a step directory that `trainguard ls` reports as valid"
        ))
    try:
        data = storage.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:  # deleted since the lookup above (retention, an operator; an object store's read)
        raise NotACheckpointError(f"{location(storage, directory)}: its {layout.MANIFEST} was deleted while it was read") from None
    return data, f"{location(storage, directory)}/{layout.MANIFEST}"


def run_dir_named(storage: Storage, directory: str) -> str:
    """For ``read_manifest``'s error: when ``directory`` holds step directories (a run directory given
    to ``trainguard inspect``/``export``/``consolidate``/``convert``, ``tg.load``), what it is, else ``""``."""
    try:
        n = sum(1 for name in storage.listdir(directory) if layout.STEP_RE.match(name))
    except OSError as e:  # a file (NotADirectoryError): the manifest or a data file given for its checkpoint
        return layout.file_given(storage, directory) if isinstance(e, NotADirectoryError) else ""
    shown = location(storage, directory)  # what the operator typed (a URL on object stores)
    which, valid = (f"one of its {n} step directories", "which are") if n > 1 else ("its step directory", "whether it is")
    return (f"{shown} is a run directory, not one checkpoint: pass {which} (`trainguard "
            f"ls {shlex.quote(shown)}` shows {valid} valid)") if n else ""  # "one of its 1 step directories" before


def absent(storage: Storage, directory: str) -> str:
    """For a "no such directory" error (``tg.load``, ``trainguard ls``/``verify``): `` (<why>)`` when the object
    store's bucket is missing (``FsspecStorage.missing_bucket``), else ``moved_aside``'s hint."""
    why = getattr(storage, "missing_bucket", lambda _: "")(directory)
    parent = location(storage, os.path.dirname(directory.rstrip("/")))  # a step mistyped: name the run's steps
    return f" ({why})" if why else moved_aside(storage, directory) or layout.other_steps(storage, directory, parent)


def moved_aside(storage: Storage, directory: str) -> str:
    """For ``read_manifest``'s error: where an overwrite cut short between its two renames left
    ``directory``'s previous checkpoint (``<name>.old-<id>``, put back by the next manager's
    ``clean_debris``), or ``""``."""
    parent, name = os.path.split(directory.rstrip("/"))
    try:  # any name tg.save wrote (``final.old-<id>`` too), not only a manager's step-N
        olds = [n for n in storage.listdir(parent) if layout.is_old_of(n, name)]
        old = next((storage.join(parent, n) for n in olds if storage.exists(storage.join(parent, n, layout.MANIFEST))), None)
    except OSError:
        return ""
    if old is None:
        return ""
    back = (f"open a CheckpointManager on {location(storage, parent)}, which puts it back" if layout.STEP_RE.match(name)
            else f"rename it back to {location(storage, directory)}")
    return f" (an overwrite of it was cut short: its previous checkpoint is {location(storage, old)}; load that path, or {back})"


def check_file_sizes(storage: Storage, directory: str, manifest: Manifest, needed: set[str]) -> None:
    """Before a byte is read (``loader._load``, ``export``, ``consolidate``): each data file of
    ``needed`` exists and has the size the manifest gives it (a truncated or replaced file is
    found here, not as a short read or a huge allocation)."""
    for f in sorted(needed):
        p = storage.join(directory, f)
        if not storage.exists(p):
            link = symlink_to(storage, p)  # a link whose target is gone: not "missing" (review57c)
            what = "data file is missing" if link is None else f"a symbolic link to {link}, which is not there"
            raise CorruptCheckpointError(f"{location(storage, p)}: {what}", file=f)
        actual = storage.size(p)
        if actual != manifest.files[f]:
            raise CorruptCheckpointError(f"{location(storage, p)}: {wrong_size(storage, p, actual, manifest.files[f])}", file=f)


def rank_files(report: dict[str, Any]) -> dict[str, int]:
    """The data files of one rank's "written" report (``api._write_rank``), name -> bytes; a rank
    that wrote no file reports its one file name with 0 bytes."""
    return report.get("files") or {report["file"]: report["size"]}


def check_shared(storage: Storage, work: str, written: list[dict[str, Any]]) -> None:
    """Rank 0, after every rank reported its files durable and before the manifest is written
    (``api.persist_and_commit``): the files of a few other ranks, the last one and up to 8 spread
    over the ranks, are in the directory rank 0 is about to commit (lookups by name: a directory
    listing may be stale on NFS). A run directory on node-local disks in a multi-node job, or a
    relative path resolved in different working directories, would otherwise commit checkpoints
    whose other ranks' files are somewhere else: every save "succeeds" and none can be loaded.
    At most 9 ranks are looked at, whatever the world size (a handful of stats per save).
    On an object store (writes in place, no run lock) rank 0's own files too: a manager opened on
    the same prefix by another job removes a save's objects as a crashed save's debris, and the
    manifest written over them committed a checkpoint with its data gone (the save "succeeded"). There every rank's
    objects are looked for in one listing of ``work`` (a request per 1,000 objects; ``samesave.check_objects``): the
    sample let a 16-rank save whose rank 2's file that open removed commit, and ``tg.load`` found it missing
    (review54a)."""
    if not storage.atomic_rename and hasattr(storage, "objects"):  # one listing: every rank's objects, as uploaded
        return check_objects(storage, work, written)  # (samesave: another save of this step at once)
    world = len(written)
    for r in sorted({world - 1, *range(1, world, max(1, world // 8))} - {0}):
        w = written[r]
        names = [f for f, size in rank_files(w).items() if size]
        names += [w["index"][0]] if w.get("index") else []
        for fname in names:
            if not storage.exists(storage.join(work, fname)):
                raise CheckpointError(
                    f"rank {r} wrote and fsynced {fname} into {work}, but rank 0 does not find it there: "
                    "the run directory must be on storage every rank shares (a parallel or network "
                    "filesystem, or an object store), not a node-local disk, and an absolute path "
                    "(a relative one is resolved in each rank's working directory)"
                )


class LazyManifest:
    """What a save returns on ranks other than 0: ``step`` and ``total_bytes`` come with the
    commit broadcast; anything else reads and validates ``manifest.json`` on first use."""

    def __init__(self, storage: Storage, directory: str, step: int, total_bytes: int) -> None:
        self.step = step
        self.total_bytes = total_bytes
        self._where = (storage, directory)
        self._full: Manifest | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_where", "_full"):
            raise AttributeError(name)
        if self._full is None:
            self._full = read_manifest(*self._where)
        return getattr(self._full, name)

    def __repr__(self) -> str:
        return f"LazyManifest(step={self.step}, total_bytes={self.total_bytes}, directory={self._where[1]!r})"


@dataclass
class StepDir:
    step: int
    name: str
    path: str
    status: str  # "committed" (manifest present, not yet verified), "incomplete" (, "unreadable": media_ok)


def list_steps(storage: Storage, root: str, *, media_ok: bool = False, known: set[str] | frozenset[str] = frozenset()) -> list[StepDir]:
    """Step directories under ``root``, oldest first; temp and old directories are not listed. Whether each holds its
    manifest comes with the listing where the storage can say (``listdir_marked``: object stores, one listing instead
    of a request per step directory); else a stat, but for the names in ``known`` (``keptseen.committed``: seen).
    With ``known`` on an object store, the names come from a delimiter listing (``listdir_dirs``: one entry per step
    directory) and only the others are stat'ed (at most ``_UNKNOWN_STATS``): the flat listing of every object
    made a KeepAll run's saves slower and slower (0.17 s a save for the first 100 saves, 0.54 s at 400-500).
    ``media_ok`` (``inspect.list_checkpoints``): a step whose manifest's stat fails with a medium's
    error (EIO) is listed with status "unreadable" instead of raising (open and restore raise)."""
    out = []
    marked = getattr(storage, "listdir_marked", None)
    names = _by_heads(storage, root, known) if marked and known and hasattr(storage, "listdir_dirs") else None
    names = names if names is not None else marked(root, layout.MANIFEST) if marked else dict.fromkeys(storage.listdir(root))
    for name, has_manifest in names.items():
        step = layout.parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        try:
            has_manifest = has_manifest if marked else name in known or storage.exists(storage.join(path, layout.MANIFEST))
        except OSError as e:
            if not media_ok or not is_media_error(e):
                raise
            has_manifest = None
        status = "committed" if has_manifest else "incomplete" if has_manifest is not None else "unreadable"
        out.append(StepDir(step, name, path, status))
    return sorted(out, key=lambda s: s.step)


def _by_heads(storage: Storage, root: str, known: set[str] | frozenset[str]) -> dict[str, bool] | None:
    """``list_steps`` with ``known`` on an object store: the step directories of one delimiter listing, a HEAD of the
    manifest of each not in ``known``; None (the flat listing, as before) for more than ``_UNKNOWN_STATS`` of them,
    or when a HEAD fails (a step whose every request the store fails, a 500: retention goes on past it)."""
    steps = [n for n in storage.listdir_dirs(root) if layout.parse_step(n) is not None]  # type: ignore[attr-defined]
    if sum(n not in known for n in steps) > _UNKNOWN_STATS:
        return None
    try:
        return {n: n in known or storage.exists(storage.join(root, n, layout.MANIFEST)) for n in steps}
    except TimeoutError:  # a hung endpoint (TRAINGUARD_STORE_TIMEOUT): not a second wait of the bound
        raise
    except Exception:  # noqa: BLE001 - whatever the client raised (a 500 to a HEAD: botocore's HTTPClientError)
        return None


def clean_debris(storage: Storage, root: str) -> list[str]:
    """Remove what crashed saves left: temp dirs, step dirs without a manifest. An ``.old-``
    dir (an overwrite that crashed between its two renames) is moved back when its step is
    missing; an ``.abandoned-<token>`` one (``retention.set_aside``) is removed when the save
    that set it aside committed, else moved back. Rank 0 only, while holding the lock. Returns
    the names removed or restored (not one that stays: ``commitfail.removed``), and on S3 the keys of the
    incomplete multipart uploads it aborted (``storage/_stale.py``)."""
    done: list[str] = []
    names = storage.listdir(root)
    for name in names:
        path = storage.join(root, name)
        if layout.TMP_RE.match(name):
            done += removed(storage, path, name)
        elif m := layout.OLD_RE.match(name):
            final = storage.join(root, layout.step_dir(int(m.group(1))))
            if not storage.exists(storage.join(final, layout.MANIFEST)) and storage.exists(
                storage.join(path, layout.MANIFEST)
            ):
                storage.remove_tree(final)
                storage.rename_dir(path, final)
                done.append(f"{name} -> {layout.step_dir(int(m.group(1)))}")
            else:
                done += removed(storage, path, name)
    for s in list_steps(storage, root):
        if s.status == "incomplete" and storage.atomic_rename and os.path.isfile(s.path):  # not a save's: left, and named
            warnings.warn(f"{s.path} is a file, not a checkpoint directory: a save of step {s.step} will fail until "
                          "it is moved away (it is not removed: trainguard did not write it)", stacklevel=2)
        elif s.status == "incomplete":
            done += removed(storage, s.path, s.name)
    uploads = getattr(storage, "abort_uploads", None)  # S3: a crashed save's multipart upload (no object: not listed)
    return done + settle_aside(storage, root, names) + (uploads(root) if uploads else [])


def settle_aside(storage: Storage, root: str, names: list[str], only: str | None = None) -> list[str]:
    """The ``.abandoned-<token>`` directories of ``names`` (``retention.set_aside``; ``only``: of
    that token): removed when a save carrying the token committed, else moved back to their step.
    Called by ``clean_debris`` (a rollback's first save crashed, or committed) and by
    ``retention.restore_candidates`` (it failed, and the run restores again). Rank 0. Returns
    what it removed or restored."""
    done = []
    aside = [(n, m) for n in names if (m := layout.ASIDE_RE.match(n)) and only in (None, m.group(2))]
    for token in {m.group(2) for _, m in aside}:
        gone = _carries(storage, root, token)
        for n, m in aside:
            final = storage.join(root, layout.step_dir(int(m.group(1))))
            if m.group(2) != token or not gone and storage.exists(final):
                continue  # not gone, and its step saved again since (by hand): left for the operator
            if gone:
                storage.remove_tree(storage.join(root, n))
            else:
                storage.rename_dir(storage.join(root, n), final)
            done.append(n if gone else f"{n} -> {layout.step_dir(int(m.group(1)))}")
    return done


def _carries(storage: Storage, root: str, token: str) -> bool:
    """``clean_debris``: whether a committed checkpoint of ``root`` carries ``aside: token`` in its
    metadata (the save that set the ``.abandoned-<token>`` directories aside committed). Only the
    manifests' leading fields are read (``manifestfacts.read_facts``), newest step first."""
    from .manifestfacts import read_facts  # it imports this module

    for s in reversed(list_steps(storage, root)):
        try:
            if s.status == "committed" and read_facts(storage, s.path)[1].get("aside") == token:
                return True
        except CheckpointError:
            continue
    return False


def occupied(storage: Storage, final: str, overwrite: bool, *, above: bool = True) -> dict[str, str]:
    """Rank 0, before a save: why ``final`` may not receive it (``{}``: it may). A committed
    checkpoint is replaced only with ``overwrite`` (and only where the storage can rename a
    directory: in place, a failed save would destroy it); a directory holding anything but a
    checkpoint's own files is never saved into (the commit would delete what it holds). ``above``: whether
    its parent may be a checkpoint (not a manager's root, checked at open: one more HEAD per save on a store)."""
    if root := bucket_root(storage, final):  # s3://bucket itself
        return {"refused": root}
    try:
        names = storage.listdir(final)
    except NotADirectoryError:
        return under_a_file(storage, final)
    foreign = [n for n in names if not layout.own_file(n)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return {"refused": (
            f"{location(storage, final)} already holds files that are not a checkpoint's ({shown}); saving there would "
            "delete them. Save into a new or empty directory (a CheckpointManager's root holds "
            "step-NNNNNNNNN directories: pass one of those, or use the manager)"
        )}
    if refused := unsafe_target(storage, final, above):  # EBUSY at the commit; deleted with it; a live run's step
        return refused
    if layout.MANIFEST not in names:
        if above:  # not a manager's (its open aborted its step directories' uploads): a killed writer's, idle
            abort_under(storage, final)
        return _drop_leftovers(storage, final, names)
    if not overwrite:
        return {"exists": f"{location(storage, final)} already holds a committed checkpoint; " + (
            "pass overwrite=True to replace it" if storage.atomic_rename else "save to a new directory (an object store cannot replace one)")}
    if not storage.atomic_rename:
        return {"refused": (
            f"{location(storage, final)} already holds a committed checkpoint and this storage cannot replace a directory "
            "atomically (object stores): a save that failed half-way would destroy it. Save to a new "
            "path, or delete the old checkpoint first"
        )}
    return {}


def _drop_leftovers(storage: Storage, final: str, names: list[str]) -> dict[str, str]:
    """``occupied``, rank 0, before the "begin" round (no rank writes yet): on an object store (writes in place),
    the files a crashed save left in ``final`` are deleted, as a local save's rename replaces them. Before, they
    stayed inside the new checkpoint (a 1-rank save over a 2-rank crash: data-00001.bin beside it, verify OK)."""
    if names and not storage.atomic_rename:
        drop_listed(storage, final)  # never raises: what it could not delete is looked for again
        if left := storage.listdir(final):
            if layout.MANIFEST in left:  # another save of this step committed meanwhile (samesave)
                return {"exists": f"{location(storage, final)} was committed by another save while this one began; save to a new directory"}
            return {"refused": f"{location(storage, final)} holds files an earlier save that did not complete left ({', '.join(left[:5])}) "
                    "that could not be deleted (see the log): delete them, or save to a new path"}
    return {}


def commit_dir(storage: Storage, parent: str, name: str, work: str, manifest: Manifest, overwrite: bool, save_id: str) -> None:
    """Rank 0, the last step of a save (``api.persist_and_commit``), only after every rank reported
    its data durable (fsynced): write the manifest into ``work``, then rename ``work`` to
    ``parent/name`` (an existing checkpoint, with ``overwrite``, goes to ``<name>.old-<id>`` first).
    First: ``parent`` is still locked by this process if it was (``runlock.check_owned``)."""
    check_owned(parent)  # an async save's run directory removed, or its .lock replaced, since save() returned
    # On an object store, only where no manifest is: another save of this step committed meanwhile (samesave).
    (storage.write_atomic if storage.atomic_rename else getattr(storage, "write_new", storage.write_atomic))(
        storage.join(work, layout.MANIFEST), manifest.to_bytes())
    fault("after_manifest", 0)
    final = storage.join(parent, name)
    if not storage.atomic_rename:
        return  # object stores: the manifest written last *is* the commit marker
    # write_atomic fsynced ``work`` after its rename: the manifest's entry is durable (one
    # directory fsync here cost 4 ms more per save on this machine)
    if storage.exists(final):
        if not overwrite and storage.exists(storage.join(final, layout.MANIFEST)):
            raise StepExistsError(f"{final} was committed by someone else during this save")
        old = storage.join(parent, layout.old_dir(name, save_id))
        try:
            storage.rename_dir(final, old)
            storage.rename_dir(work, final)
        except BaseException as e:
            _put_back(storage, old, final)
            renamed_anyway(storage, work, final, e)  # raises e, unless only the sync after the rename failed
        storage.remove_tree(old)
    else:
        try:
            storage.rename_dir(work, final)
        except OSError as e:  # lost a race (EEXIST): another save of this step renamed its directory first
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise StepExistsError(f"{final} was committed by someone else during this save") from e
            renamed_anyway(storage, work, final, e)
    fault("after_rename", 0)


def _put_back(storage: Storage, old: str, final: str) -> None:
    """``commit_dir``, an overwrite whose renames failed (I/O error, Ctrl-C) after the previous checkpoint
    went to ``old``: moved back to ``final`` unless the new one got there (only an fsync failed)."""
    try:
        if not storage.exists(final) and storage.exists(storage.join(old, layout.MANIFEST)):
            storage.rename_dir(old, final)
    except OSError as e:
        warnings.warn(f"could not move the previous checkpoint {old} back to {final}: {e}", stacklevel=2)
