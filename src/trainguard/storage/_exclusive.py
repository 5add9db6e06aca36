"""Object-store writes that never replace an object another save wrote: S3 conditional writes.

An object store has no directory rename, so a save writes its objects in place into ``step-N/``
(``fsspec.FsspecStorage``). Two plain ``tg.save`` calls of the same step at once (two processes;
no run lock on an object store) each found the step free, then uploaded over each other: both
returned, and the step held one save's manifest over the other's data (``verify``: checksum
mismatch), or a committed checkpoint's data was replaced after its save returned. Now each data
object, index and manifest of a save is created with ``If-None-Match: *`` (``PutObject``,
``CompleteMultipartUpload``): the store refuses (HTTP 412) an object that exists, and the save
that comes second fails with ``ConcurrentSaveError`` instead of writing over the first.

Callers: ``_uploads._S3Upload.complete`` (every rank, its data files) and
``FsspecStorage.write_new`` (each rank's index file, rank 0's manifest). A store that does not
implement the header (HTTP 501), or a client that does not know it (botocore before 1.35, with
s3fs 2023.x-2024.6: ``ParamValidationError``, no request sent; every save failed with it), is
written to unconditionally, as before, once per storage (a warning; the listing checks stay).
A 412 to a request the client retried after a lost answer (the first try created the object) is
told apart by a token of that create call in the object's metadata (``TOKEN``, ``new_token``):
this save's own object is not a conflict. Not by its ETag (review54f): two saves of the same
bytes (a job launched twice with one seed) make objects of one ETag, so the save that came
second took the first's objects for its own, failed at the first's manifest, and deleted them
(``samesave.remove_own``): the committed checkpoint lost its data.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError

log = logging.getLogger("trainguard")


class ConcurrentSaveError(CheckpointError):
    """Another save of the same step wrote into (or removed from) its directory during this save (object stores):
    this save is abandoned; its own objects are removed, the other's left (``samesave``)."""


def _answer(e: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status behind s3fs's translated ``OSError`` (its ``__cause__``)."""
    for err in (e, e.__cause__, e.__context__):
        resp = getattr(err, "response", None)
        if isinstance(resp, dict):
            return str(resp.get("Error", {}).get("Code", "")), int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return "", 0


TOKEN = "trainguard-create"  # the user metadata (x-amz-meta-trainguard-create) naming one create call


def new_token() -> dict[str, dict[str, str]]:
    """The ``Metadata`` argument of one create (``PutObject``, or the ``CreateMultipartUpload`` of a multipart one):
    a token no other call has; ``create`` finds it on the object after a 412."""
    return {"Metadata": {TOKEN: uuid.uuid4().hex}}


def remember(etags: dict[str, str], path: str, etag: str, keep: int = 4096) -> None:
    """``etags[path] = etag`` (``FsspecStorage._etags``), the oldest dropped past ``keep``: a save's ranks take theirs
    (``written_etag``); the RAM tier's copies and ``consolidate`` never do, and must not grow it for good."""
    etags[path] = etag
    while len(etags) > keep:
        try:
            etags.pop(next(iter(etags)))
        except (RuntimeError, KeyError, StopIteration):  # another thread's insert or pop meanwhile: next time
            break


def _unknown_parameter(e: BaseException) -> bool:
    """Whether ``e`` is botocore's refusal of ``IfNoneMatch`` as an unknown parameter (a client before 1.35):
    raised before any request, as is (s3fs translates only the store's answers)."""
    return type(e).__name__ == "ParamValidationError" and "IfNoneMatch" in str(e)


def create(fs: Any, bucket: str, key: str, call: Callable[..., dict[str, Any]], token: dict[str, dict[str, str]],
           state: dict[str, bool]) -> str:
    """``call(**extra)`` (a ``PutObject`` or ``CompleteMultipartUpload``) with ``If-None-Match: *``; returns the
    new object's ETag. ``ConcurrentSaveError`` when ``s3://bucket/key`` exists and is not the object this call
    made (``token``: ``new_token()``, given to the call that created the object: a 412 to a retry after a lost
answer, the object's metadata holds it). ``state["unconditional"]``: the store
    answered 501 to the header once: written as before, without it."""
    if state.get("unconditional"):
        return str(call().get("ETag", ""))
    try:
        return str(call(IfNoneMatch="*").get("ETag", ""))
    except Exception as e:  # noqa: BLE001 - an old client's refusal of the parameter, else the store's OSError
        if _unknown_parameter(e):
            state["unconditional"] = True
            log.warning("trainguard: this S3 client (botocore) does not know conditional writes (If-None-Match; "
                        "botocore >= 1.35 does): objects are written unconditionally, and two saves of one step at "
                        "once are found only by the listing before the manifest. Upgrade s3fs/botocore")
            return str(call().get("ETag", ""))
        if not isinstance(e, OSError):
            raise
        code, status = _answer(e)
        if status == 501 or code == "NotImplemented":
            state["unconditional"] = True
            return str(call().get("ETag", ""))
        # 409 ConditionalRequestConflict (AWS): another conditional write or a delete of the key at the same time,
        # a conflict as a 412 is; raised as the store's error, the save's cleanup removed the whole step (review54f)
        if status not in (409, 412) and code not in ("PreconditionFailed", "ConditionalRequestConflict"):
            raise
    try:
        head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        head = {}
    if head and (head.get("Metadata") or {}).get(TOKEN) == token["Metadata"][TOKEN]:  # ours: a retry of a request
        return str(head.get("ETag", ""))  # whose first try made it (the same bytes of another save: another token)
    raise ConcurrentSaveError(
        f"s3://{bucket}/{key} was written by another save while this save wrote it: two saves of the same step "
        "directory ran at once (an object store has no lock). This save is abandoned and the other's objects are "
        "left as they are; save each step once (one job per run directory), then check it with `trainguard verify`")
