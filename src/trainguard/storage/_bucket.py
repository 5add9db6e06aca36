"""A missing S3 bucket is refused, not created.

``s3fs.S3FileSystem.makedirs("bucket/run")`` creates the bucket when it does not exist, so a
typo in the bucket name (``s3://checkpoits/run1``) made a new bucket and every save "succeeded"
into it, where the next job (with the right name) finds nothing to resume from; on AWS it also
creates a bucket the operator never meant to own. ``FsspecStorage.makedirs`` (every rank and
thread that creates a directory: the manager's open on rank 0, each save's staging directory)
calls :func:`need_bucket` first, once per bucket and storage object.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..permanent import mark


def need_bucket(io: Any, path: str, seen: set[str]) -> None:
    """Raise a permanent ``CheckpointError`` when the bucket of ``path`` ("bucket/run1/...") does not exist;
    ``seen`` holds the buckets already found (one request per bucket)."""
    bucket = path.strip("/").split("/", 1)[0]
    if not bucket or bucket in seen:
        return
    try:  # not fs.exists: it answers False for an unreachable endpoint too (the open's error says that)
        io.call_s3("head_bucket", Bucket=bucket)
    except PermissionError:  # there, or another account's: makedirs and the writes will tell
        return
    except FileNotFoundError:
        raise mark(CheckpointError(  # permanent: a restart does not create it
            f"s3://{bucket} does not exist: trainguard does not create buckets (a typo in the name would make a "
            f"new one). Create it first (e.g. `aws s3 mb s3://{bucket}`) or correct the URL"
        )) from None
    seen.add(bucket)
