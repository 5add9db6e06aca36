"""Object stores and other fsspec filesystems (``s3://``, ``gs://``, ``memory://``, ...).

Object stores have no atomic directory rename, so ``atomic_rename`` is False: ``api.save``
writes the data objects in place into the final step "directory" (a key prefix), and
rank 0 writes ``manifest.json`` LAST; its presence is the commit marker. Discovery
(``commit.list_steps``) treats a step without it as incomplete and ``clean_debris`` removes
it; ``remove_tree`` deletes the marker FIRST, so a retention delete that dies half-way leaves
an incomplete step (ignored, cleaned later), never a manifest whose data is gone.

Writes: each rank's data file is cut into parts of ``part_size`` bytes. ``pwrite`` (called
from ``io.write_file``'s threads) copies bytes into the part's buffer; a part whose bytes
are all there is uploaded at once on a small thread pool (S3: one ``upload_part`` each, in
parallel; other filesystems: streamed in order through ``fs.open(path, "wb")``).
``hole`` counts a gap between chunks as written zeros (``io.write_batches``, ``writegaps``: a part
with a gap was held until ``finish``). ``finish(size)`` uploads the rest (holes are zeros) and completes the upload; the object
appears whole or not at all. Once a part fails, no later part is sent and the next ``pwrite``
(or ``finish``) raises its error: against a hung endpoint each part waited out the store's bound.
Reads: ``readinto`` fetches byte ranges, large ones split into pieces fetched concurrently
(``fs.cat_ranges``). A missing S3 bucket is refused (``_bucket``).
Credentials, endpoints: the filesystem's (S3: the boto chain, ``AWS_ENDPOINT_URL``). Each call is bounded (``_bounded``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from .. import layout
from ..errors import CheckpointError, error_text
from ..streamjobs import DaemonExecutor
from ._bounded import Bounded, store_timeout
from ._bucket import need_bucket
from ._exclusive import create, new_token, remember
from ._reads import READ_PIECE, _RangeReader  # noqa: F401  (READ_PIECE: tests)
from ._remote import remote as _remote
from ._remove import remove_keys, remove_prefix
from ._stale import abort_uploads
from ._uploads import _S3Upload, _StreamUpload
from ._urls import BUCKETED, check_object_path, http_exists, import_fsspec, read_only

log = logging.getLogger("trainguard")

PART_SIZE = 32 << 20  # upload part (larger for a file of more than MAX_PARTS)
MAX_PARTS = 10_000  # S3's most parts of one multipart upload (part 10,001 is refused): 312.5 GiB of 32 MiB parts
UPLOAD_THREADS = 4  # parts uploaded at once per open file
MAX_BUFFERED_PARTS = 8  # complete parts waiting for upload before pwrite blocks (bounds memory)


class FsspecStorage:
    """A :class:`~trainguard.storage.base.Storage` over any fsspec filesystem.

    Built by ``storage.for_path(url)`` (via :meth:`from_url`) in every process that touches the
    checkpoint; holds no per-save state, so one instance serves threads and saves alike.
    """

    atomic_rename = False
    bucketed = False  # a path's first segment is a bucket (s3://, gs://): set by from_url

    def __init__(self, fs: Any, *, part_size: int = PART_SIZE) -> None:
        if part_size < (5 << 20):
            raise ValueError(f"part_size={part_size}: S3 needs parts of at least 5 MiB")
        self._s3 = type(fs).__name__ == "S3FileSystem" and hasattr(fs, "call_s3")
        self._http = type(fs).__name__ == "HTTPFileSystem"  # exists(strict=True): an unreachable host raises
        self.fs, self.io = fs, Bounded(fs, store_timeout())  # I/O through io: bounded, a hung endpoint must not hang the job
        self.part_size = part_size
        self._buckets: set[str] = set()  # buckets found to exist (_bucket.need_bucket)
        self._exclusive: dict[str, bool] = {}  # _exclusive.create's: the store answered 501 to If-None-Match
        self._etags: dict[str, str] = {}  # written_etag: path -> ETag of the object this process created there

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> tuple[FsspecStorage, str]:
        """``(storage, path inside it)`` for ``url`` (``"s3://bucket/run1"`` -> ``"bucket/run1"``). A scheme
        without a filesystem, or a server that a filesystem connecting on construction (``ftp://``) cannot
        reach, is a ``CheckpointError`` naming the URL (``storage.for_path``: every command and load)."""
        fsspec = import_fsspec()
        scheme, sep, rest = url.partition("://")  # case-insensitive (RFC 3986); fsspec knows "s3", not "S3": its
        try:  # "Protocol not known: S3" was told as "install the package for the scheme, e.g. s3fs"
            fs, path = fsspec.core.url_to_fs(scheme.lower() + sep + rest, **storage_options)
        except (ImportError, ValueError) as e:
            raise CheckpointError(
                f"{url}: no fsspec filesystem for this URL ({e}). Install the package for the scheme, "
                "e.g. s3fs for s3://, gcsfs for gs://"
            ) from e
        except OSError as e:  # ftp://, sftp://, hdfs:// connect here: "error: Name or service not known" named no URL
            raise CheckpointError(
                f"{url}: cannot reach the filesystem's server ({type(e).__name__}: {e.strerror or e}); check the host "
                "name (and port) in the URL, and that the server answers from this machine"
            ) from e
        storage = cls(fs)
        storage.bucketed = scheme.lower() in BUCKETED  # its root is a bucket's (``_urls.bucket_root``)
        return storage, check_object_path(url, path)

    def _fresh(self, path: str) -> None:
        # Listings are cached by fsspec; another process (or rank) may have written since.
        self.fs.invalidate_cache(path)

    def join(self, *parts: str) -> str:
        head, *rest = parts
        return "/".join([head.rstrip("/"), *(p.strip("/") for p in rest)]) if rest else head

    def makedirs(self, path: str) -> None:
        read_only(self, path)
        if self._s3:  # no directories to make; s3fs's makedirs would create a missing bucket (one it may not see)
            return need_bucket(self.io, path, self._buckets)
        self.io.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` that hold at least one object. One flat listing: a
        "directory" emptied by a delete (some servers keep a folder entry) is not listed."""
        return sorted(self.listdir_marked(path, layout.MANIFEST))

    @_remote
    def listdir_marked(self, path: str, marker: str) -> dict[str, bool]:
        """``listdir(path)``, each name with whether it holds the object ``<name>/<marker>``, from
        the same one flat listing: ``commit.list_steps`` (every manager open, restore and
        retention, on rank 0) learns which step directories hold a manifest without one request
        per step directory."""
        self._fresh(path)
        base = path.rstrip("/") + "/"
        try:
            keys = self.io.find(path, withdirs=False)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, bool] = {}
        for k in keys:
            if k.startswith(base) and not k.endswith("/"):
                name, _, rest = k[len(base) :].partition("/")
                if name:
                    out[name] = out.get(name, False) or rest == marker
        return out

    @_remote
    def listdir_dirs(self, path: str) -> list[str]:
        """Names directly under ``path`` from one delimiter listing (S3: ``ListObjectsV2`` with ``Delimiter="/"``,
        one entry per step directory, not per object). ``commit.list_steps`` for retention (rank 0, each save), where
        the manager knows which names hold a manifest: the flat listing (``listdir_marked``) took 0.24-0.29 s of a
        0.35-0.39 s save with 1,100 objects. A name may be an emptied "directory" (a server's folder entry)."""
        self._fresh(path)
        try:
            return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.io.ls(path, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def url(self, path: str) -> str:
        """The URL that ``storage.for_path`` maps back to ``path``; ``memory:///run`` (fsspec's) as ``memory://run``, as users
        write it (both are ``/run``): one message named both before polish58."""
        return "memory://" + u[10:] if (u := str(self.fs.unstrip_protocol(path))).startswith("memory:///") else u

    @_remote
    def exists(self, path: str) -> bool:
        """Whether ``path`` is there. HTTP: ``_urls.http_exists`` (a host it cannot reach, a 5xx: raised, not absence)."""
        self._fresh(path)
        return http_exists(self.io, path) if self._http else bool(self.io.exists(path))

    @_remote
    def size(self, path: str) -> int:
        self._fresh(path)
        return int(self.io.size(path))

    @_remote
    def read_bytes(self, path: str, limit: int) -> bytes:
        try:
            return bytes(self.io.cat_file(path, start=0, end=limit + 1))
        except OSError as e:  # S3 answers a ranged GET of an empty object 416 (InvalidRange): it is empty, not unreadable
            if not isinstance(e, TimeoutError) and self.io.size(path) == 0:  # (a hung endpoint: no second wait)
                return b""
            raise

    @_remote  # its 403 says "check the credentials" (errors.error_text), as a read's
    def write_atomic(self, path: str, data: bytes) -> None:
        # A single PUT: the object appears whole or not at all.
        read_only(self, path)
        self.io.pipe_file(path, bytes(data))

    @_remote
    def write_new(self, path: str, data: bytes) -> None:
        """``write_atomic``, but only where no object is (S3: ``If-None-Match``, ``_exclusive``): a save's
        index files (each rank) and manifest (rank 0, ``commit.commit_dir``). ``ConcurrentSaveError`` when
        another save of the step wrote ``path`` first; elsewhere (``memory://``, gcsfs) as ``write_atomic``."""
        if not self._s3:
            return self.write_atomic(path, data)
        bucket, key, _ = self.io.split_path(path)
        body, token = bytes(data), new_token()
        remember(self._etags, path, create(self.io, bucket, key, lambda **kw: self.io.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=body, **token, **kw), token, self._exclusive))
        self._fresh(path)

    @_remote
    def objects(self, path: str) -> dict[str, tuple[int, str]]:
        """The objects directly under ``path`` from one flat listing: name -> (size, ETag; ``""`` where the
        filesystem gives none). ``samesave`` (rank 0, before a save's manifest and after a failed one)."""
        self._fresh(path)
        base = path.rstrip("/") + "/"
        try:
            found = self.io.find(path, withdirs=False, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {k[len(base):]: (int(info.get("size") or 0), str(info.get("ETag") or ""))
                for k, info in found.items() if k.startswith(base) and "/" not in k[len(base):] and k[len(base):]}

    @_remote
    def remove_objects(self, paths: list[str]) -> None:
        """Delete exactly the objects ``paths`` (``samesave.remove_own``: a failed save's own, not the step's)."""
        remove_keys(self.io, self._s3, paths)
        for p in paths:
            self._fresh(p)

    @property
    def unconditional(self) -> bool:
        """Whether this storage's creates are written without ``If-None-Match`` (the store answered 501, or the
        client does not know it: ``_exclusive.create``): ``samesave.remove_own`` then removes nothing."""
        return bool(self._exclusive.get("unconditional"))

    def written_etag(self, path: str) -> str:
        """The ETag of the object this process created at ``path`` (``write_new``, a data file's upload), once:
        ``api._write_rank`` reports it, and rank 0 finds the object is still that one before the manifest
        (``samesave.check_objects``); ``""`` when unknown (not S3)."""
        return self._etags.pop(path, "")

    def rename_dir(self, src: str, dst: str) -> None:
        raise CheckpointError(f"cannot rename {src} to {dst}: object stores have no directory rename (atomic_rename is False)")

    def remove_tree(self, path: str) -> None:
        marker = self.join(path, layout.MANIFEST)
        # Invariant: the commit marker goes first, so a delete that dies half-way leaves an
        # incomplete step (ignored by discovery), never a manifest pointing at missing data.
        # Best effort, like the local backend: a failure leaves debris that is cleaned later.
        try:
            self._fresh(path)
            remove_prefix(self.io, self._s3, path, marker)  # exact keys: rm() would glob-expand [*?] in path
        except (FileNotFoundError, NotImplementedError):  # NotImplementedError: http(s)://, read-only (read_only)
            pass
        except Exception as e:
            if isinstance(e, OSError):
                e.remote = True  # type: ignore[attr-defined]  # a 403: "check the credentials" (error_text)
            log.warning("trainguard: could not remove %s (left for the next cleanup): %s", path, error_text(e))
        self._fresh(path)

    def fsync_dir(self, path: str) -> None:
        """Nothing to do: a completed PUT is durable."""

    def missing_bucket(self, path: str) -> str:
        """For a "no such directory" error (``commit.absent``: ``tg.load``, ``trainguard ls``/``verify``): why, when
        ``path``'s S3 bucket does not exist (they said only "no such directory": one looked for the prefix), else ``""``."""
        try:
            if self._s3:
                need_bucket(self.io, path, self._buckets)
        except CheckpointError:  # need_bucket's: no such bucket
            bucket = path.strip("/").split("/", 1)[0]
            return (f"the bucket s3://{bucket} does not exist: check the bucket's name in the URL, and the endpoint "
                    "(AWS_ENDPOINT_URL) and account")
        except Exception:  # noqa: BLE001 - only a hint: the error raised is the caller's
            pass
        return ""

    def abort_uploads(self, root: str) -> list[str]:
        """``commit.clean_debris`` (rank 0, a manager's open): abort the idle multipart uploads crashed saves left in
        ``root``'s step directories (S3; parts no listing shows, billed until aborted; a live one stays: ``_stale``)."""
        return abort_uploads(self, root) if self._s3 else []

    def open_write(self, path: str) -> _PartWriter:
        read_only(self, path)
        return _PartWriter(self, path)

    def open_read(self, path: str) -> _RangeReader:
        return _RangeReader(self.io, path)


class _PartWriter:
    """Assembles pwrite'd bytes into fixed-size parts and uploads complete parts in parallel."""

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.fs, self.path, self.P = storage.io, path, storage.part_size
        self._lock = threading.Lock()
        self._bufs: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._free: list[bytearray] = []
        self._slots = threading.BoundedSemaphore(MAX_BUFFERED_PARTS)
        self._pool = DaemonExecutor(UPLOAD_THREADS, "trainguard-upload")  # not joined at exit: a hung upload
        self._futures: list[Any] = []  # concurrent.futures.Future
        self._sent: set[int] = set()
        self._gaps: dict[int, int] = {}  # bytes of holes (``hole``) in parts that have no buffer yet
        self._error: BaseException | None = None  # the first part upload that failed: no later part goes up
        self._aborted = False
        self._up: _S3Upload | _StreamUpload = (_S3Upload(self.fs, path, storage._exclusive) if storage._s3
                                               else _StreamUpload(self.fs, path))
        self._etags = storage._etags

    def reserve(self, size: int) -> None:
        """``io.reserve``, before the first write: a file of more than ``MAX_PARTS`` parts gets larger parts (S3),
        a whole MiB each. Before, a rank file over 312.5 GiB failed at part 10,001, after 312.5 GiB went up."""
        if isinstance(self._up, _S3Upload) and size > MAX_PARTS * self.P and not (self._sent or self._bufs or self._gaps):
            self.P = -(-size // (MAX_PARTS << 20)) << 20

    def _buffer(self, k: int) -> bytearray:
        with self._lock:
            buf = self._bufs.get(k)
            if buf is None:
                if self._free:  # a reused part buffer: zeroed, so that holes between chunks are zeros
                    buf = self._free.pop()
                    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))
                else:
                    buf = bytearray(self.P)
                self._bufs[k] = buf
                self._filled[k] = self._gaps.pop(k, 0)
            return buf

    @_remote
    def pwrite(self, data: memoryview, offset: int) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._fill(offset, len(view), view)

    @_remote
    def hole(self, offset: int, length: int) -> None:
        """Bytes ``offset:offset+length`` are never written (``io.write_batches``: a gap between chunks,
        ``writegaps``): they count as written, zeros, so a part with a gap is sent once its data is there
        (before, it was held in memory until ``finish``: the whole file, when no chunk filled whole pages)."""
        self._fill(offset, length, None)

    def _fill(self, offset: int, n: int, view: memoryview | None) -> None:
        pos = 0
        while pos < n:
            k, start = divmod(offset + pos, self.P)
            take = min(self.P - start, n - pos)
            if view is None:  # a hole: counted now, its part's buffer made (zeroed) by the part's first write
                with self._lock:
                    if k not in self._bufs and self._gaps.get(k, 0) + take < self.P:
                        self._gaps[k] = self._gaps.get(k, 0) + take
                        pos += take
                        continue
            buf = self._buffer(k)  # zeroed: a hole's bytes are zeros already
            if view is not None:
                buf[start : start + take] = view[pos : pos + take]  # disjoint ranges: no lock needed
            with self._lock:
                self._filled[k] += take
                full = self._filled[k] == self.P
                if full:
                    del self._bufs[k], self._filled[k]
            if full:
                self._submit(k, buf, self.P)
            pos += take

    def _submit(self, k: int, buf: bytearray, length: int) -> None:
        self._slots.acquire()  # bounds the memory of parts waiting for upload
        if self._error is not None:  # a part failed: the file cannot complete; the save fails now (pwrite, finish
            self._slots.release()  # raise), not after every later part waited out the store's bound too
            raise self._error
        self._sent.add(k)

        def run() -> None:
            try:
                if self._error is None:  # queued behind a part that failed: not sent
                    # A whole part goes up from its buffer as is (botocore takes a bytearray; aiohttp copies it twice
                    # while it sends: its slice, then joined with the headers; docs/storage.md, memory).
                    self._up.part(k, buf if length == len(buf) else bytes(memoryview(buf)[:length]))
            except BaseException as e:
                self._error = self._error or e
                raise
            finally:
                with self._lock:
                    if len(self._free) < 2:
                        self._free.append(buf)
                self._slots.release()

        self._futures.append(self._pool.submit(run))

    @_remote
    def finish(self, size: int) -> None:
        try:
            last = -(-size // self.P)
            for k in range(last):
                with self._lock:
                    buf = self._bufs.pop(k, None)
                    self._filled.pop(k, None)
                if buf is None and k not in self._sent:
                    buf = bytearray(self.P)  # a part never written to: a hole of zeros
                if buf is not None:
                    self._submit(k, buf, min(self.P, size - k * self.P))
            for f in self._futures:
                f.result()
            self._up.complete(last, size)
            if isinstance(self._up, _S3Upload):
                remember(self._etags, self.path, self._up.etag)
        except BaseException:
            self.abort()
            raise
        finally:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._aborted:  # finish() aborted, then its caller (io.write_batches): one abort request, one wait
            return
        self._aborted = True
        try:
            self._up.abort()
        except Exception:  # best effort: the incomplete step is cleaned at the next start
            pass
