"""The uploads of ``fsspec._PartWriter`` (one per data file a rank writes to an object store):
``_S3Upload`` sends each part as soon as it is complete (S3 multipart upload), ``_StreamUpload``
streams them in order through the filesystem's file object (any other fsspec filesystem). Both are
called from the writer's upload threads (``part``) and from the save's thread (``complete``, ``abort``).
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError
from ._exclusive import create, new_token


class _S3Upload:
    """S3 multipart upload through s3fs's ``call_s3`` (thread-safe: it runs on fsspec's loop). The object is
    created only where none is (``_exclusive.create``: another save of the step wrote it meanwhile, an error);
    ``etag``: its ETag once complete (``FsspecStorage.written_etag``). ``state``: the storage's ``_exclusive``
    state (the store ignores conditional writes)."""

    def __init__(self, fs: Any, path: str, state: dict[str, bool] | None = None) -> None:
        self.fs, self.state = fs, state if state is not None else {}
        self.etag = ""
        self.token = new_token()  # in the object's metadata: a 412 to a retry of this upload's create is ours
        self.bucket, self.key, _ = fs.split_path(path)
        self._lock = threading.Lock()
        self._id: str | None = None
        self._etags: dict[int, str] = {}
        self._small: bytes | None = None
        self._failed: BaseException | None = None  # create_multipart_upload's error: raised to every part

    def _upload_id(self) -> str:
        with self._lock:
            if self._failed is not None:  # tried once: the other parts' threads waited on this lock for it, and
                raise self._failed  # each tried again in turn (a hung endpoint: one bound each, one after another)
            if self._id is None:
                try:
                    self._id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key,
                                                   **self.token)["UploadId"]
                except BaseException as e:
                    self._failed = e
                    raise
            return self._id

    def part(self, k: int, data: bytes | bytearray) -> None:
        if k == 0 and self._id is None and len(self._etags) == 0 and len(data) < PART_SIZE_MIN_MULTIPART:
            self._small = bytes(data)  # maybe the whole file: one PUT at complete()
            return
        uid = self._upload_id()
        with self._aborted():
            r = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=uid, PartNumber=k + 1, Body=data)
        with self._lock:
            self._etags[k] = r["ETag"]

    def complete(self, nparts: int, size: int) -> None:
        if self._id is None:
            body = self._small or b""
            self.etag = create(self.fs, self.bucket, self.key, lambda **kw: self.fs.call_s3(
                "put_object", Bucket=self.bucket, Key=self.key, Body=body, **self.token, **kw), self.token, self.state)
            self.fs.invalidate_cache(f"{self.bucket}/{self.key}")
            return
        if self._small is not None:  # part 0 was held back but the file has more parts
            self.part(0, self._small)
            self._small = None
        missing = [k for k in range(nparts) if k not in self._etags]
        if missing:
            raise CheckpointError(f"{self.key}: parts {missing} were never uploaded")
        parts = [{"PartNumber": k + 1, "ETag": self._etags[k]} for k in range(nparts)]
        with self._aborted():
            self.etag = create(self.fs, self.bucket, self.key, lambda **kw: self.fs.call_s3(
                "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._id,
                MultipartUpload={"Parts": parts}, **kw), self.token, self.state)
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    @contextlib.contextmanager
    def _aborted(self) -> Iterator[None]:
        """A 404 (NoSuchUpload) to a part or the completion: someone aborted this live upload. It said only "the
        specified multipart upload does not exist" (review54a); now who may have and what to change. Only that
        code: a bucket deleted during the save (NoSuchBucket) was told as an aborted upload too, "HTTP 404
        (NoSuchBucket): the upload ... was aborted ... by a CheckpointManager" (review54d); it is named as such."""
        try:
            yield
        except FileNotFoundError as e:
            code = getattr(e.__cause__, "response", {}).get("Error", {}).get("Code")  # s3fs keeps the ClientError
            if code in (None, "NoSuchUpload") and self._bucket_gone():  # a store may drop a deleted bucket's
                code = "NoSuchBucket"  # uploads first (SeaweedFS, to a part sent during the delete: it then had the
                # bucket again, so HEAD says 200 and the upload is told as aborted, session 57)
            if code == "NoSuchBucket":
                raise FileNotFoundError(errno.ENOENT, (
                    f"the bucket {self.bucket} was deleted while "
                    f"this save was writing {self.key}: create it again, or save to another bucket")) from e
            if code not in (None, "NoSuchUpload"):
                raise
            raise FileNotFoundError(errno.ENOENT, (
                f"the upload of {self.bucket}/{self.key} was aborted while this save was writing it: by a "
                "CheckpointManager opened on this run directory by another job after this upload was idle for long "
                "(object stores have no run lock: give each job its own prefix), or by a bucket lifecycle rule that "
                "aborts incomplete uploads sooner than a save takes")) from e

    def _bucket_gone(self) -> bool:
        """``_aborted``: whether the bucket answers 404 now (deleted), False when it is there or the question fails."""
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            return True
        except Exception:  # noqa: BLE001  (any other answer: not known to be gone; the upload's error stands)
            return False
        return False

    def abort(self) -> None:
        if self._id is not None:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._id)


PART_SIZE_MIN_MULTIPART = 5 << 20  # a lone part below S3's minimum is sent as a plain PUT


class _StreamUpload:
    """Any fsspec filesystem: parts are written in order through ``fs.open(path, "wb")``; a
    part completed early waits in memory for its predecessors. Nothing is visible before close."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self._lock = threading.Lock()
        self._next = 0
        self._ready: dict[int, bytes] = {}
        self._file: Any = None

    def part(self, k: int, data: bytes | bytearray) -> None:
        with self._lock:
            self._ready[k] = bytes(data)
            while self._next in self._ready:
                if self._file is None:
                    self._file = self.fs.open(self.path, "wb")
                self._file.write(self._ready.pop(self._next))
                self._next += 1

    def complete(self, nparts: int, size: int) -> None:
        with self._lock:
            if self._next != nparts or self._ready:
                raise CheckpointError(f"{self.path}: parts out of order at completion ({self._next} of {nparts})")
            if self._file is None:
                self.fs.pipe_file(self.path, b"")
            else:
                self._file.close()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None and hasattr(f, "discard"):
            f.discard()
