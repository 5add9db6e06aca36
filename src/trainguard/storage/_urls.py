"""What ``storage.for_path`` (every process that opens a checkpoint path) accepts as a URL.

- ``file:`` URLs are local paths in all their spellings: ``file:///x``, ``file://localhost/x``
  and ``file:/x`` are ``/x`` (the last two were taken for relative paths under the working
  directory, and the save landed there); ``file://otherhost/x`` is refused.
- An object-store URL with an empty path segment (``s3://b/run//step``) is refused: servers
  differ on it (SeaweedFS drops the empty segment, AWS keeps it in the key), so saves to such a
  URL "succeeded" while nothing under the listed prefix could be found to restore from.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError


def import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CheckpointError(
            "URLs such as s3://... need fsspec: pip install 'trainguard[fsspec]' (and s3fs for s3://, gcsfs for gs://)"
        ) from e
    return fsspec


def is_file_url(p: str) -> bool:
    return p[:5].lower() == "file:"


def file_url_path(p: str) -> str:
    """The local path of a ``file:`` URL, every character after the host kept as it is (``?`` and
    ``#`` are part of a local name, not a query or a fragment); a ``CheckpointError`` for a URL
    that names another host or no path."""
    rest = p[5:]
    if rest.startswith("//"):
        host, sep, tail = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise CheckpointError(f"{p}: a file: URL of another host ({host}); give a local path (or mount it)")
        rest = sep + tail
    if not rest:
        raise CheckpointError(f"{p}: a file: URL without a path; give file:///absolute/path or a path")
    return rest


# Schemes whose first path segment is a bucket (container): an empty one is the whole store, or nothing.
BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


def check_object_path(url: str, path: str) -> str:
    """``path`` (inside the store, from fsspec) without a trailing ``/``; a ``CheckpointError``
    when ``url`` holds an empty segment (``//``) after its ``scheme://``, or names no bucket
    (``s3://``, ``s3:///run``) on a store of buckets."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() in BUCKETED and not path.split("/")[0]:  # s3fs: "Cannot traverse all of S3", a traceback
        raise CheckpointError(f"{url}: names no bucket; write {scheme}://<bucket>/<run directory>")
    if "//" in rest.strip("/"):
        fixed = scheme + "://" + "/".join(s for s in rest.split("/") if s)
        raise CheckpointError(
            f"{url}: an empty path segment ('//'): object stores differ on it (one drops it, another keeps "
            f"it in the key), so what is saved may not be found again. Write {fixed}")
    return path.rstrip("/") or path


def bucket_root(storage: Any, path: str) -> str:
    """``commit.occupied`` (rank 0, before a plain ``tg.save``, ``consolidate`` or a DCP import writes one checkpoint
    into ``path``): why ``path`` may not hold one, when it is the root of a bucket (``s3://bucket``), else ``""``.
    The checkpoint's files would lie among the bucket's other objects, and the save took the bucket's key prefix
    for ``"/bucket/"``: it found nothing there, so a second save went in place over a committed checkpoint and a
    failed one's objects were never removed. A ``CheckpointManager`` may use a bucket's root as its run directory
    (its checkpoints are ``s3://bucket/step-N``)."""
    if not getattr(storage, "bucketed", False) or "/" in path.strip("/"):
        return ""
    url = storage.url(path.strip("/"))
    return (f"{url} is the root of a bucket: a checkpoint needs a prefix of its own. Save to {url}/<name> "
            f"(e.g. {url}/ckpt-1); a CheckpointManager may use {url} as its run directory")


def read_only(storage: Any, path: str) -> None:
    """``FsspecStorage``'s check before a write (``makedirs``, ``write_atomic``, ``open_write``) to ``path``:
    an ``http(s)://`` URL (``storage._http``) is refused, which fsspec's HTTP filesystem cannot write. A save,
    ``consolidate`` or an import into one failed with "NotImplementedError: " and nothing else
    (``consolidate``: a traceback, exit 1). Permanent: no restart fixes it."""
    if not storage._http:
        return
    err = CheckpointError(f"{storage.url(path)}: an http(s):// URL is read-only (fsspec's HTTP filesystem cannot "
                          "write); save to a local path or an object store's URL (s3://, gs://), and read from "
                          "http(s):// only")
    err.permanent = True
    raise err


def http_exists(io: Any, path: str) -> bool:
    """``FsspecStorage.exists`` of an ``http(s)://`` URL (``io``: its bounded filesystem): fsspec's strict
    ``exists``, so that a host that cannot be reached (DNS, a refused connection) or that fails (a 5xx) is
    raised, not read as absence (review56d). Any other 4xx than 404 is absence too, as fsspec's non-strict
    ``exists`` read it: a server that answers 403 for a missing object (S3 or GCS over https without the
    right to list, a CDN) or for a directory it does not index (nginx) says the path is not there for this
    client. With strict 4xx's, ``trainguard verify https://HOST/run`` of such a server failed ("the object
    store failed: ClientResponseError: 403", exit 2) at its first probe, ``run/manifest.json`` (is the run
    directory a checkpoint itself?), where it verified the run before session 56 (review56j)."""
    try:
        return bool(io.exists(path, strict=True))
    except Exception as e:
        status = getattr(e, "status", None)  # aiohttp's ClientResponseError: the host answered
        if isinstance(status, int) and 400 <= status < 500:
            return False
        raise
