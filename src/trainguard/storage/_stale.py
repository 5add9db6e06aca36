"""``FsspecStorage.abort_uploads``: abort the S3 multipart uploads that crashed saves left in a run directory.

A save killed while its data file was going up (SIGKILL, a node lost, the OOM killer) leaves an
*incomplete multipart upload*: its parts are stored (and billed, by AWS and most providers) but are
no object, so no listing shows them and the debris cleanup, which deletes objects, never removed
them. Measured on SeaweedFS: a 34 MB model's save killed after its first part left 32 MiB of parts
under ``step-000000003/data-00000.bin``, still there after the next manager's open and every later
save. Only a bucket lifecycle rule ever removed them.

``commit.clean_debris`` (rank 0, at a manager's ``open``, before any save of that manager) calls it:
every upload whose key lies in a step directory of the run directory (``step-N/`` or a save's
``step-N.tmp-<id>/``) is aborted. No save of this run is in progress then; another job's would be, if
two jobs shared the prefix, which docs/storage.md says not to do (that open removes its objects too).
Best effort: a store that refuses the listing (a policy without ``s3:ListBucketMultipartUploads``) or
an abort is warned about, and the open goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import layout
from ..errors import error_text

log = logging.getLogger("trainguard")
MAX_PAGES = 100  # 1,000 uploads a page; a server that says "truncated" without a marker is not asked forever


def _in_step_dir(rel: str) -> bool:
    name, sep, rest = rel.partition("/")
    return bool(sep and rest) and (layout.parse_step(name) is not None or bool(layout.TMP_RE.match(name)))


def abort_uploads(io: Any, root: str) -> list[str]:
    """Abort the incomplete multipart uploads under ``root`` ("bucket/run1") whose key is in a step
    directory; returns their keys relative to ``root`` ("step-000000003/data-00000.bin (upload)")."""
    bucket, _, prefix = root.strip("/").partition("/")
    prefix = prefix + "/" if prefix else ""
    done: list[str] = []
    try:
        uploads = _list(io, bucket, prefix)
    except Exception as e:  # noqa: BLE001 - best effort: the open goes on
        log.warning("trainguard: could not list the incomplete multipart uploads under s3://%s/%s (%s): those of "
                    "crashed saves stay (add a bucket lifecycle rule that aborts them)", bucket, prefix, error_text(e))
        return done
    for key, upload_id in uploads:
        rel = key[len(prefix):]
        if not _in_step_dir(rel):
            continue
        try:
            io.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:  # gone meanwhile (completed or aborted)
            continue
        except Exception as e:  # noqa: BLE001
            log.warning("trainguard: could not abort the incomplete upload of s3://%s/%s (%s)", bucket, key,
                        error_text(e))
            continue
        done.append(f"{rel} (upload)")
    return done


def _list(io: Any, bucket: str, prefix: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    markers: dict[str, str] = {}
    for _ in range(MAX_PAGES):
        page = io.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        got = [(u["Key"], u["UploadId"]) for u in page.get("Uploads") or [] if u.get("Key", "").startswith(prefix)]
        out += got
        key, uid = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
        if not page.get("IsTruncated") or not got or not key:
            break
        markers = {"KeyMarker": key, **({"UploadIdMarker": uid} if uid else {})}
    return out
