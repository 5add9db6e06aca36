"""``FsspecStorage.abort_uploads``: abort the S3 multipart uploads that crashed saves left in a run directory.

A save killed while its data file was going up (SIGKILL, a node lost, the OOM killer) leaves an
*incomplete multipart upload*: its parts are stored (and billed, by AWS and most providers) but are
no object, so no listing shows them and the debris cleanup, which deletes objects, never removed
them. Measured on SeaweedFS: a 34 MB model's save killed after its first part left 32 MiB of parts
under ``step-000000003/data-00000.bin``, still there after the next manager's open and every later
save. Only a bucket lifecycle rule ever removed them.

``commit.clean_debris`` (rank 0, at a manager's ``open``) calls it: an upload whose key lies in a step directory of
the run directory (``step-N/`` or ``step-N.tmp-<id>/``) is aborted once it is *idle*: nothing of it (its creation,
its newest part, by the store's clock) for ``IDLE_BOUNDS`` store bounds (``TRAINGUARD_STORE_TIMEOUT``, at least its
default: each call of a live writer, a part's upload included, ends within the writer's, which may be the default). Before (store53), every one was aborted: another process's
manager opened on the run (an eval job's restore, a restarted trainer while the old one's last save went on) failed
the live save with "NoSuchUpload" (review54a). One left young is looked at again by ``recheck``, at the first
retention (rank 0, after a save) once that much time has passed since (and so on while one is left young): a
restart right after a crash leaves its upload young at the open. Object stores have no run lock: the live save's finished objects in its step
directory are left as well while active (``active``).
Best effort: a store that refuses the listing (a policy without ``s3:ListBucketMultipartUploads``) or
an abort is warned about, and the open goes on.

``active`` is the same test for a step directory without a manifest (``commitfail.removed``, from ``clean_debris``):
one with an object or an upload active within the idle limit may be a live save's (its finished rank files wait for
the manifest while other ranks upload) and is left, for ``recheck``. Until review55c the open deleted such objects
and the live save failed at its file check ("data-00000.bin, uploaded by rank 0 in this save, is not in ...").
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from .. import layout
from ..errors import error_text
from ._bounded import DEFAULT_STORE_TIMEOUT

log = logging.getLogger("trainguard")
MAX_PAGES = 100  # 1,000 uploads a page; a server that says "truncated" without a marker is not asked forever
IDLE_BOUNDS = 2.0  # store bounds an upload is idle before it counts as a dead save's (a part's call ends within one)


def _in_step_dir(rel: str) -> bool:
    name, sep, rest = rel.partition("/")
    return bool(sep and rest) and (layout.parse_step(name) is not None or bool(layout.TMP_RE.match(name)))


def abort_uploads(storage: Any, root: str) -> list[str]:
    """Abort the idle incomplete multipart uploads under ``root`` ("bucket/run1") whose key is in a step
    directory; returns their keys relative to ``root`` ("step-000000003/data-00000.bin (upload)"). One not idle
    yet is left, and ``recheck`` due for ``root``."""
    io, limit = storage.io, _idle_limit(storage)
    bucket, _, prefix = root.strip("/").partition("/")
    prefix = prefix + "/" if prefix else ""
    done: list[str] = []
    try:
        uploads, now = _list(io, bucket, prefix)
    except Exception as e:  # noqa: BLE001 - best effort: the open goes on
        log.warning("trainguard: could not list the incomplete multipart uploads under s3://%s/%s (%s): those of "
                    "crashed saves stay (add a bucket lifecycle rule that aborts them)", bucket, prefix, error_text(e))
        return done
    young = []
    for key, upload_id, initiated in uploads:
        rel = key[len(prefix):]
        if not _in_step_dir(rel):
            continue
        try:
            if not _idle(io, bucket, key, upload_id, initiated, now, limit):
                young.append(rel)  # maybe a live save's (another process's): looked at again later
                continue
            io.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:  # gone meanwhile (completed or aborted)
            continue
        except Exception as e:  # noqa: BLE001
            log.warning("trainguard: could not abort the incomplete upload of s3://%s/%s (%s)", bucket, key,
                        error_text(e))
            continue
        done.append(f"{rel} (upload)")
    if young:
        log.info("trainguard: left %d incomplete upload(s) in s3://%s/%s, active within %.0f s (maybe a save in "
                 "progress): %s", len(young), bucket, prefix, limit, young[:5])
    left = storage.__dict__.get("_dirs_left", {}).get(root)  # step directories ``active`` left: looked at again too
    storage.__dict__.setdefault("_uploads_opened", {})[root] = time.monotonic() if young or left else None
    return done


_UNLISTED: set[str] = set()  # ``abort_under``: buckets whose upload listing failed (no s3:ListBucketMultipartUploads)


def abort_under(storage: Any, path: str) -> list[str]:
    """``commit.occupied``, rank 0, before a plain ``tg.save``, ``consolidate`` or ``convert`` writes the checkpoint
    ``path`` in place on S3: abort the idle incomplete multipart uploads under it that a killed writer of it left (a
    manager's open looks only in its run directory's step directories: ``abort_uploads``). Before (hunt58 tmp58), a
    ``consolidate`` killed mid-upload left its parts, billed, for good. One active within the idle limit may be a live
    writer's: left, with a warning saying how to abort it. Returns the keys aborted; never raises. A listing that
    is refused (``PermissionError``: a policy without ``s3:ListBucketMultipartUploads``) is warned about once per
    bucket and process, and not asked again: before (review58f), every plain ``tg.save`` onto such a bucket paid a refused request and logged a
    warning."""
    if not getattr(storage, "_s3", False):
        return []
    io, limit = storage.io, _idle_limit(storage)
    bucket, _, key = path.strip("/").partition("/")
    done: list[str] = []
    if bucket in _UNLISTED:  # refused before, in this process: not asked (nor warned about) once per save
        return done
    try:
        uploads, now = _list(io, bucket, key.rstrip("/") + "/")
    except Exception as e:  # noqa: BLE001 - best effort: the write goes on
        denied = isinstance(e, PermissionError)  # a policy's refusal stays; a timeout, a dead server may not
        if denied:
            _UNLISTED.add(bucket)
        log.warning("trainguard: could not list the incomplete multipart uploads under s3://%s (%s): those a killed "
                    "writer left stay (add a bucket lifecycle rule that aborts them)%s", path, error_text(e),
                    "; not asked again in this process" if denied else "")
        return done
    for k, upload_id, initiated in uploads:
        try:
            if not _idle(io, bucket, k, upload_id, initiated, now, limit):
                log.warning("trainguard: left the incomplete upload of s3://%s/%s, active within %.0f s (maybe a live "
                            "writer's); once nothing writes s3://%s, abort it: aws s3api abort-multipart-upload "
                            "--bucket %s --key %s --upload-id %s", bucket, k, limit, path, bucket, k, upload_id)
                continue
            io.call_s3("abort_multipart_upload", Bucket=bucket, Key=k, UploadId=upload_id)
        except FileNotFoundError:  # completed or aborted meanwhile
            continue
        except Exception as e:  # noqa: BLE001
            log.warning("trainguard: could not abort the incomplete upload of s3://%s/%s (%s)", bucket, k, error_text(e))
            continue
        done.append(k)
    if done:
        log.warning("trainguard: aborted %d incomplete upload(s) a killed writer left under s3://%s: %s", len(done),
                    path, done[:5])
    return done


def recheck(storage: Any, root: str) -> list[str]:
    """``retention.apply_retention`` (rank 0, after a save): once ``IDLE_BOUNDS`` store bounds have passed since
    ``abort_uploads`` left a young upload in ``root`` (or ``active`` a step directory without a manifest),
    the step directories left that still have no manifest and are idle now are removed, and ``abort_uploads``
    runs again; else nothing, no request."""
    opened = getattr(storage, "_uploads_opened", {}).get(root)
    if opened is None or time.monotonic() - opened < _idle_limit(storage):
        return []
    storage._uploads_opened[root] = None
    done = []
    for path in sorted(storage.__dict__.get("_dirs_left", {}).pop(root, set())):
        try:  # one the store fails on stays (the next open looks again); the uploads are still looked at
            if not storage.exists(storage.join(path, layout.MANIFEST)) and not active(storage, path):
                done += [path.rstrip("/").rsplit("/", 1)[-1]] if drop_incomplete(storage, path) else []
        except Exception as e:  # noqa: BLE001
            log.warning("trainguard: could not remove %s, left by a crashed save (%s)", path, error_text(e))
    return done + abort_uploads(storage, root)


def active(storage: Any, path: str) -> bool:
    """``commitfail.removed`` (``commit.clean_debris``, rank 0 at a manager's open; ``recheck``): whether the S3 step
    directory ``path`` ("bucket/run1/step-000000002", no manifest) has an object written or a multipart upload
    active within the idle limit (``_idle_limit``, by the store's clock): a live save's, maybe another process's
    (a save waits with its finished rank files until every rank uploaded). Such a directory is left and recorded
    for ``recheck``. False on other stores (local disk has the run lock) and when the store cannot say (the
    removal goes on, as before)."""
    if not getattr(storage, "_s3", False):
        return False
    io, limit = storage.io, _idle_limit(storage)
    bucket, _, key = path.strip("/").partition("/")
    prefix, token, young = key.rstrip("/") + "/", {}, False
    try:
        for _ in range(MAX_PAGES):
            page = io.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, **token)
            now = _server_time(page) or datetime.now(timezone.utc)
            if young := any(_age(now, o.get("LastModified")) < limit for o in page.get("Contents") or []):
                break
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}
        if not young:
            uploads, now = _list(io, bucket, prefix)
            young = any(_live(io, bucket, k, u, i, now, limit) for k, u, i in uploads)
    except Exception:  # noqa: BLE001 - best effort: removed as before
        return False
    if young:
        root = path.rstrip("/").rsplit("/", 1)[0]
        storage.__dict__.setdefault("_dirs_left", {}).setdefault(root, set()).add(path)
        log.info("trainguard: left %s (no manifest): written to within %.0f s, maybe a save in progress", path, limit)
    return young


def drop_incomplete(storage: Any, path: str) -> bool:
    """``commitfail.removed`` (``commit.clean_debris``, rank 0 at a manager's open) and ``recheck`` (retention, rank
    0), on an object store, once ``active`` found the step directory ``path`` idle: delete the objects of one listing
    of it, unless that listing holds a manifest (a save committed it since the caller looked: left, as it is).
    Returns whether ``path`` holds nothing now. Before (review56a), ``remove_tree`` came after ``active``'s requests
    (listings of the objects, the uploads, their parts) and deleted ``manifest.json`` first, whatever it was: a
    save of the step that committed while they ran (its rank 0 waited for a slow rank) lost its checkpoint, though
    its save had returned. The listing and the deletes are the window left (an object store has no lock, and a
    delete cannot be made conditional on another object's absence): a manifest that appears in it is kept and
    warned about. Best effort, as ``remove_tree``: a failure is logged and the directory is left (False)."""
    try:
        have = storage.objects(path)
        if layout.MANIFEST in have:
            log.info("trainguard: left %s: a save committed it while it was looked at as a crashed save's", path)
            return False
        folder = [path.rstrip("/") + "/"] if getattr(storage, "_s3", False) else []  # SeaweedFS's folder entry
        # (its children stay); and objects in a "subdirectory" (a hand copy's), which remove_tree removed too
        storage.remove_objects([storage.join(path, n) for n in sorted(have)] + _nested(storage, path) + folder)
        left = storage.objects(path) or dict.fromkeys(_nested(storage, path))
        if not left:
            drop_dir(storage, path)
    except Exception as e:  # noqa: BLE001 - as remove_tree: left for the next cleanup
        log.warning("trainguard: could not remove %s (left for the next cleanup): %s", path, error_text(e))
        return False
    if layout.MANIFEST in left:
        log.warning("trainguard: a save committed %s while its objects were removed as a crashed save's (no lock on "
                    "an object store: give each job its own prefix): check it with `trainguard verify`", path)
    return not left


def _nested(storage: Any, path: str) -> list[str]:
    """``drop_incomplete``: the objects under ``path`` that ``objects`` (those directly under it) does not list. Before
    (review56i), they stayed, and each open's warning said the step directory was removed (``listdir``'s flat listing
    names it for them: debris again, open after open)."""
    base = path.rstrip("/") + "/"
    try:
        keys = storage.io.find(path, withdirs=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(k for k in keys if k.startswith(base) and "/" in k[len(base):].rstrip("/"))


def drop_dir(storage: Any, path: str) -> None:
    """``drop_incomplete`` and ``samesave.drop_failed``, once the objects of the step directory ``path`` went: on a
    filesystem with directories (``memory://``, sftp, HDFS; a save's ``makedirs`` made one) the directory itself, if
    empty (``rmdir``: one a save wrote into since stays). S3's folder entry goes with the objects (the callers').
    Before (review56i), a failed save's cleanup left the empty directory (``remove_tree`` had removed it): listed by
    each retention's ``listdir_dirs`` ever after, never by the open's debris listing (objects only)."""
    if getattr(storage, "_s3", False) or not hasattr(storage, "io"):
        return
    try:
        found = storage.io.find(path, withdirs=True, detail=True)
    except (OSError, NotImplementedError):
        found = {}
    base = path.rstrip("/") + "/"
    for d in [*sorted((k for k, v in found.items() if v.get("type") == "directory" and k.startswith(base)),
                      key=len, reverse=True), path]:  # the deepest first
        try:
            storage.io.rmdir(d)
        except (OSError, NotImplementedError):  # not empty (written to since), gone, or a store without directories
            pass


def _live(io: Any, bucket: str, key: str, upload_id: str, initiated: Any, now: datetime, limit: float) -> bool:
    try:
        return not _idle(io, bucket, key, upload_id, initiated, now, limit)
    except FileNotFoundError:  # completed or aborted meanwhile
        return False


def _idle_limit(storage: Any) -> float:
    """Seconds an upload must be idle to be aborted: ``IDLE_BOUNDS`` times this process's store bound, but at least
    its default's. The bound that holds a live writer is the writer's, not the opener's: an eval job with
    ``TRAINGUARD_STORE_TIMEOUT=1`` aborted a trainer's upload (default bound) whose part was going up for 3 s, and
    that save failed (review54d). A writer whose bound is above the default is not covered (docs/storage.md)."""
    return IDLE_BOUNDS * max(storage.io._bound, DEFAULT_STORE_TIMEOUT)


def _idle(io: Any, bucket: str, key: str, upload_id: str, initiated: Any, now: datetime, limit: float) -> bool:
    """Whether nothing of the upload (its creation, its newest part) is newer than ``limit`` seconds before ``now``
    (the store's clock). A part list only for an upload created before that (one request a page, 1,000 parts)."""
    if _age(now, initiated) < limit:
        return False
    marker: dict[str, Any] = {}
    for _ in range(MAX_PAGES):
        page = io.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id, **marker)
        if any(_age(now, p.get("LastModified")) < limit for p in page.get("Parts") or []):
            return False
        if not page.get("IsTruncated") or not page.get("NextPartNumberMarker"):
            break
        marker = {"PartNumberMarker": page["NextPartNumberMarker"]}
    return True


def _age(now: datetime, t: Any) -> float:
    """Seconds from ``t`` (a time the store gave; naive: UTC) to ``now``; 0 (young: left) for no time."""
    if not isinstance(t, datetime):
        return 0.0
    return (now - (t if t.tzinfo else t.replace(tzinfo=timezone.utc))).total_seconds()


def _list(io: Any, bucket: str, prefix: str) -> tuple[list[tuple[str, str, Any]], datetime]:
    """The uploads under ``prefix`` (key, upload id, creation time) and the store's clock (its answer's ``Date``)."""
    out: list[tuple[str, str, Any]] = []
    markers: dict[str, str] = {}
    now = None
    for _ in range(MAX_PAGES):
        page = io.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        now = now or _server_time(page)
        got = [(u["Key"], u["UploadId"], u.get("Initiated")) for u in page.get("Uploads") or []
               if u.get("Key", "").startswith(prefix)]
        out += got
        key, uid = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
        if not page.get("IsTruncated") or not got or not key:
            break
        markers = {"KeyMarker": key, **({"UploadIdMarker": uid} if uid else {})}
    return out, now or datetime.now(timezone.utc)


def _server_time(page: dict[str, Any]) -> datetime | None:
    """The ``Date`` of the store's answer (its clock, which its upload times use; this host's may differ)."""
    try:
        now = parsedate_to_datetime(page["ResponseMetadata"]["HTTPHeaders"]["date"])
        return now if now.tzinfo else now.replace(tzinfo=timezone.utc)
    except (KeyError, TypeError, ValueError):
        return None
