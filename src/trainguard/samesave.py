"""Two saves of the same step into an object store at once (no run lock there): rank 0's checks.

On a local disk each save writes into its own temp directory and one rename commits it (the
second finds the step taken: ``StepExistsError``). An object store has neither: every save writes
in place into ``step-N/`` (``api.persist_and_commit``). Two plain ``tg.save`` calls of one step
in two processes both returned, leaving one save's manifest over the other's data (``verify``:
checksum mismatch), or a committed checkpoint whose data the other save replaced after it
returned. Now:

- each object is created only where none is (S3 conditional writes, ``storage/_exclusive``): a
  save's upload that finds another save's object there fails with ``ConcurrentSaveError``;
- each rank reports the ETags of the objects it created (``written_etags``, ``api._write_rank``);
- rank 0, before the manifest (``commit.check_shared`` -> ``check_objects``), lists the step once:
  each object the ranks reported is there, unchanged, and the step holds no data or index file of
  another save, nor a manifest; else ``ConcurrentSaveError`` (one LIST per 1,000 objects,
  in place of the HEADs of up to 9 ranks' files);
- a save that failed that way removes only the objects it created itself (``remove_own``, from
  ``commitfail.discard``, rank 0): before, a failed save deleted the whole step, the other save's
  objects (and manifest) with it.

So one save commits and the other gets an error, or both get one; never a checkpoint mixing both.
Stores that ignore conditional writes (no ``If-None-Match``; ``memory://``) keep the listing check.
"""

from __future__ import annotations

import logging
from typing import Any

from . import layout
from .errors import error_text
from .storage import Storage, location
from .storage._exclusive import ConcurrentSaveError

log = logging.getLogger("trainguard")


def written_etags(storage: Storage, work: str, names: list[str]) -> dict[str, str]:
    """``api._write_rank`` (every rank, after its files are complete): the ETags of the objects ``names`` it created
    under ``work`` (``FsspecStorage.written_etag``); ``{}`` where the storage gives none (a local disk)."""
    got = getattr(storage, "written_etag", None)
    return {n: e for n in names if (e := got(storage.join(work, n)))} if got else {}


def _ours(written: list[dict[str, Any]]) -> dict[str, tuple[int, int, str]]:
    """name -> (rank, size, ETag or "") of every file the ranks' reports name."""
    out: dict[str, tuple[int, int, str]] = {}
    for r, w in enumerate(written):
        if not isinstance(w, dict) or "file" not in w:  # a rank that failed: it names no file
            continue
        tags = w.get("etags") or {}
        files = dict(w.get("files") or {w["file"]: w["size"]})
        if w.get("index"):
            files[w["index"][0]] = w["index"][1]
        for name, size in files.items():
            out[name] = (r, size, tags.get(name, ""))
    return out


def check_objects(storage: Any, work: str, written: list[dict[str, Any]], manifest: str | None = None) -> None:
    """Rank 0, after every rank reported its objects complete and before the manifest (``commit.check_shared`` on
    an object store): ``work`` holds every object the ranks reported, as they created it (size, ETag), and no
    data or index file nor manifest that this save did not write (``manifest``: the ETag of its own, once written:
    ``recheck``). ``ConcurrentSaveError`` names what differs."""
    have, shown = storage.objects(work), location(storage, work)
    # its own manifest; one whose ETag it does not know ("": not S3, a listing that gives ETags) too (review54f)
    if manifest is not None and (not manifest or have.get(layout.MANIFEST, (0, None))[1] == manifest):
        del have[layout.MANIFEST]
    for name, (rank, size, etag) in sorted(_ours(written).items()):
        got = have.get(name)
        if got is None:  # a listing that lags behind the writes: a HEAD before the save fails (none usually)
            if size and not storage.exists(storage.join(work, name)):
                raise ConcurrentSaveError(
                    f"{name}, uploaded by rank {rank} into {shown} in this save, is gone before its manifest was "
                    "written: another job using the same run directory removed it (a CheckpointManager opening there, "
                    "or a save of the same step, deletes objects of a step without a manifest). Object stores have no "
                    "run lock: give each job its own prefix, and save each step once" + ("" if not rank else
                    f"; or rank {rank} saved it elsewhere: every rank must pass the same URL, with the same endpoint "
                    "and bucket (not a path made from the host name)"))
        elif got[0] != size or etag and got[1] and got[1] != etag:
            raise ConcurrentSaveError(
                f"{name}, uploaded by rank {rank} into {shown} in this save, was replaced by another save of the same "
                "step during this save: two saves of one step ran at once (object stores have no "
                "lock). This save is abandoned; save each step once")
    ours = _ours(written)
    other = sorted(n for n in have if n not in ours and (n == layout.MANIFEST or layout.own_file(n)))
    if other:
        raise ConcurrentSaveError(
            f"{shown} holds {', '.join(other[:5])}, which this save did not write: another save of the same step is "
            "writing there at the same time (object stores have no lock). This save is abandoned; save each step once")


def recheck(storage: Storage, work: str, written: list[dict[str, Any]]) -> None:
    """``api.persist_and_commit``, rank 0, right after its manifest went up (object stores): ``check_objects`` once
    more. A save of the same step that started meanwhile takes this save's objects for a crashed save's and deletes
    them (``commit.occupied``): in the moment between the check before the manifest and the manifest, the step
    would commit another save's data. Then this save's manifest is deleted again and ``ConcurrentSaveError`` raised.
    A listing that fails (the store's error) leaves the save committed, with a warning: it must not fail (and
    remove) a checkpoint whose manifest is up."""
    if storage.atomic_rename or not hasattr(storage, "objects"):
        return
    path = storage.join(work, layout.MANIFEST)
    etag = storage.written_etag(path)  # type: ignore[attr-defined]
    try:
        check_objects(storage, work, written, etag)
    except ConcurrentSaveError:
        if not etag or storage.objects(work).get(layout.MANIFEST, (0, None))[1] == etag:  # type: ignore[attr-defined]
            storage.remove_objects([path])  # type: ignore[attr-defined]
        raise
    except Exception as e:  # noqa: BLE001 - the listing failed (a 503): the save is committed, as before this check
        log.warning("trainguard: %s is committed; listing it again after its manifest failed (%s): another save of "
                    "the same step at the same time is not looked for", location(storage, work), error_text(e))


def concurrent(outcome: dict[str, Any], error: BaseException | None) -> bool:
    """Whether a failed save's ``outcome`` (or this process's ``error``) is a ``ConcurrentSaveError`` of any rank."""
    return isinstance(error, ConcurrentSaveError) or ConcurrentSaveError.__name__ in str(outcome)


def remove_own(storage: Any, work: str, written: list[dict[str, Any]] | None) -> None:
    """``commitfail.discard`` (rank 0) of a save that met another save of its step: delete the objects its ranks
    created (listed with the ETag they reported), not the step: the other save's objects stay. Without the
    ranks' reports (one never answered) or ETags (not S3), nothing: what is left is cleaned as any crashed save's.
    Nothing either where the store took writes unconditionally (``FsspecStorage.unconditional``): there the other
    save may have written the same bytes over this one's (one ETag), and committed them (review54f: two saves of
    the same bytes, the one that lost deleted the committed checkpoint's data). Nor, while the step holds a
    manifest (another save's, committed), an object that manifest names: where it holds the same bytes as this
    save's own (one ETag), the other committed it. Before (review55g), a save that deleted the other's
    objects as a crashed save's (``drop_listed``) and uploaded the same bytes saw the other commit over them
    (its check found its sizes and ETags), failed at that manifest, and removed them: the committed checkpoint,
    whose save had returned, had no data. Left open (no lock on an object store): such a save that commits between
    this listing and the deletes; a manifest seen after them is warned about."""
    if not written or getattr(storage, "unconditional", False):  # written over: an ETag names bytes, not a save
        return
    have = storage.objects(work)
    if layout.MANIFEST in have:  # another save's (``recheck`` deleted this one's): the objects it names stay
        try:
            from .commit import read_manifest  # it imports this module

            m = read_manifest(storage, work)
        except Exception:  # noqa: BLE001 - unreadable or gone meanwhile: nothing is removed
            return
        have = {n: v for n, v in have.items() if n not in m.files and n not in m.indexes}
    mine = [storage.join(work, n) for n, (_r, _s, etag) in _ours(written).items()
            if n in have and etag and have[n][1] == etag]
    if mine:
        storage.remove_objects(mine)
        if layout.MANIFEST not in have and layout.MANIFEST in storage.objects(work):  # (review56a) the moment
            log.warning("trainguard: another save committed %s while this failed save removed its own objects: if "  # left
                        "it wrote the same bytes (one ETag), its data may be gone: check it with `trainguard verify`",
                        location(storage, work))


def drop_failed(storage: Any, work: str, mine: Any = None) -> None:
    """``commitfail.discard`` (rank 0) and ``discard_late`` (a rank named failed) of an object-store save that failed
    for a reason of its own (an upload's error, a refused endpoint; not ``concurrent``): delete the objects of one
    listing of ``work`` (the step itself), but never a manifest this save did not write (``mine``: the ``Manifest``
    it wrote, or None), nor an object such a manifest names. Before (review56a), ``remove_tree`` deleted the whole
    step, manifest first: a save of the same step that committed while this one wrote (no run lock on an object
    store) lost its checkpoint, though its save had returned. Best effort, as ``remove_tree``: a failed request is
    logged, and what is left is cleaned as a crashed save's (``commit.clean_debris``). A save that commits between
    this listing and its deletes may still lose objects: see docs/storage.md (two saves of one step)."""
    if not hasattr(storage, "objects"):
        return storage.remove_tree(work)
    try:
        have, keep = storage.objects(work), {layout.MANIFEST}
        if layout.MANIFEST in have:
            keep = _committed_names(storage, work, mine)
        names = [storage.join(work, n) for n in sorted(have) if n not in keep]
        if keep <= {layout.MANIFEST} and getattr(storage, "_s3", False):  # none committed: SeaweedFS's folder entry
            names.append(work.rstrip("/") + "/")  # (deleting it leaves any object under it: measured)
        if names:
            storage.remove_objects(names)
        if keep <= {layout.MANIFEST}:  # none committed: the directory too, where it is one (memory://, sftp)
            from .storage._stale import drop_dir

            drop_dir(storage, work)
    except Exception as e:  # noqa: BLE001 - as remove_tree: left for the next cleanup
        log.warning("trainguard: could not remove %s, left by a save that failed (%s): the next CheckpointManager "
                    "open removes it", location(storage, work), error_text(e))


def _committed_names(storage: Any, work: str, mine: Any) -> set[str]:
    """``drop_failed``, where ``work`` holds a manifest: the names to leave. None when the manifest is this save's
    own (``mine`` wrote those bytes: deleted, the commit marker first); else the manifest and what it names (another
    save's commit), or, when it cannot be read, every name of the step (a manifest this save may not judge)."""
    from .manifest import MAX_MANIFEST_BYTES, parse

    path = storage.join(work, layout.MANIFEST)
    try:
        data = storage.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:  # deleted since the listing: nothing committed to leave
        return set()
    try:
        ours = mine is not None and data == mine.to_bytes()
    except Exception:  # noqa: BLE001 - a manifest too large to write (to_bytes refused it): not the one there
        ours = False
    if ours:
        storage.remove_objects([path])
        return {layout.MANIFEST}
    try:
        m = parse(data, location(storage, path))
    except Exception:  # noqa: BLE001 - another's, unreadable: its step is left whole
        return set(storage.objects(work))
    return {layout.MANIFEST, *m.files, *m.indexes}


def drop_listed(storage: Any, final: str) -> None:
    """``commit.occupied`` (rank 0, before a plain save's "begin" round) of an object-store step without a manifest:
    delete the objects a crashed save left, those of one listing only (``FsspecStorage.objects``), not the step:
    ``remove_tree`` deletes ``manifest.json`` first, and a save of the same step that committed since the listing
    lost its manifest. Elsewhere ``remove_tree``. Never raises (a failed delete is logged): the caller lists again."""
    if not hasattr(storage, "objects"):
        return storage.remove_tree(final)
    try:
        if names := [storage.join(final, n) for n in storage.objects(final) if n != layout.MANIFEST]:
            storage.remove_objects(names)
    except Exception as e:  # noqa: BLE001 - as remove_tree: what is left is named by the caller
        log.warning("trainguard: could not remove %s (an earlier save's objects): %s", final, error_text(e))
