"""``FsspecStorage.remove_tree``: delete the objects under one exact prefix, nothing else.

fsspec's ``rm(path, recursive=True)`` expands ``path`` as a glob pattern first: ``*``, ``?`` and
``[...]`` in it match other names. A run directory named ``s3://ckpt/run[1]`` (or ``exp-?``)
made retention's delete of ``run[1]/step-000000001`` remove ``run1/step-000000001``, another
run's committed checkpoint, and left its own step as debris (found by an audit; on memory:// and
SeaweedFS alike). So on S3 the keys are listed (``find``: a prefix listing, no pattern) and
deleted by exact name with ``DeleteObjects`` (1,000 keys a request); on other filesystems a path
without those characters is removed by ``rm`` as before (its batched deletes: gcsfs), one with
them key by key.

Callers: ``commit`` (retention, ``clean_debris``, a failed save's cleanup), ``tiers`` and
``consolidate``, through ``FsspecStorage.remove_tree`` on whichever rank removes the step (rank 0
for a manager's). The commit marker is deleted FIRST (an incomplete step, never a manifest whose
data is gone).
"""

from __future__ import annotations

from glob import has_magic  # what fsspec's rm and expand_path test: * ? [
from typing import Any

BATCH = 1000  # S3 DeleteObjects takes at most 1,000 keys


def remove_prefix(io: Any, s3: bool, path: str, marker: str) -> None:
    """Delete ``marker`` (``<path>/manifest.json``), then every object whose key starts with
    ``path + "/"`` and the empty directory entries left under it; raises ``FileNotFoundError``
    when nothing is there, any other error of the store as it is."""
    try:
        io.rm_file(marker)
    except FileNotFoundError:
        pass
    if not s3 and not has_magic(path):
        io.rm(path, recursive=True)  # no pattern to expand: the filesystem's own (batched) recursive delete
        return
    base = path.rstrip("/") + "/"
    found = io.find(path, withdirs=True, detail=True)
    keys = sorted(k for k, info in found.items() if k.startswith(base) and info.get("type") != "directory")
    if s3:  # and the key ``<path>/``: SeaweedFS keeps an emptied folder, which a delimiter listing then shows
        # (``FsspecStorage.listdir_dirs``: each deleted step looked for again); elsewhere a no-op. Not for a bucket's
        # root: its key would be "", which botocore refuses (ParamValidationError): nothing of it was deleted.
        keys += [base] if "/" in base.strip("/") else []
        for i in range(0, len(keys), BATCH):
            _delete_objects(io, keys[i : i + BATCH])
        return  # no directory entries to remove (s3fs's rmdir of a bucket's root would delete the bucket)
    for k in keys:
        io.rm_file(k)
    dirs = sorted((k for k, info in found.items() if info.get("type") == "directory" and k.startswith(base)),
                  key=len, reverse=True)  # deepest first
    for d in [*dirs, path]:
        try:
            io.rmdir(d)
        except (OSError, NotImplementedError):
            pass  # not empty (written to since the listing), or already gone


def _delete_objects(io: Any, keys: list[str]) -> None:
    bucket = keys[0].split("/", 1)[0]
    objects = [{"Key": k.split("/", 1)[1]} for k in keys]
    out = io.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
    errors = out.get("Errors") or []
    if errors:
        first = errors[0]
        raise OSError(f"could not delete {len(errors)} object(s) of s3://{bucket}, e.g. {first.get('Key')}: "
                      f"{first.get('Code')} {first.get('Message')}")


def remove_keys(io: Any, s3: bool, keys: list[str]) -> None:
    """Delete exactly ``keys`` ("bucket/run/step-N/data-00000.bin"; ``FsspecStorage.remove_objects``); one gone already is no error."""
    if s3:
        for i in range(0, len(keys), BATCH):
            _delete_objects(io, keys[i : i + BATCH])
        return
    for k in keys:
        try:
            io.rm_file(k)
        except FileNotFoundError:
            pass
