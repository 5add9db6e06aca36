"""Hunt 54 (review54f): a hostile review of store54's object-store saves (If-None-Match creates, listing checks),
against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture; skips without ``weed``)."""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _old_botocore(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A client whose botocore predates conditional writes (botocore < 1.35: s3fs 2023.x-2024.6, which the project
    allows): its parameter validation refuses ``IfNoneMatch`` before any request is sent, as those versions do."""
    from botocore import validate
    from botocore.exceptions import ParamValidationError

    refused: list[str] = []
    real = validate.ParamValidator.validate

    def validate_old(self, params, shape):  # noqa: ANN001
        if isinstance(params, dict) and "IfNoneMatch" in params:
            refused.append(shape.name)
            raise ParamValidationError(report='Unknown parameter in input: "IfNoneMatch", must be one of: Bucket, Key')
        return real(self, params, shape)

    monkeypatch.setattr(validate.ParamValidator, "validate", validate_old)
    return refused


@pytest.mark.parametrize("size", [1 << 10, 40 << 20], ids=["put", "multipart"])
def test_a_save_with_a_botocore_that_predates_conditional_writes_succeeds(weed, monkeypatch, size):  # noqa: F811
    """Every object of a save is created with ``If-None-Match: *``. A botocore older than 1.35 (allowed:
    ``s3fs>=2023.1``) does not know the parameter and raises ``ParamValidationError`` (not an ``OSError``) before
    sending anything. Before: every save to S3 failed with it (``Parameter validation failed: Unknown parameter in
    input: "IfNoneMatch"``). Now the object is written as before, unconditionally (the store is treated as one that
    answers 501 to the header), and the save commits and verifies."""
    refused = _old_botocore(monkeypatch)
    url = _url() + "/ckpt"
    w = torch.arange(size // 4, dtype=torch.float32)
    tg.save(url, {"w": w})
    assert refused, "the old client's validation was not reached"
    assert tg.verify(url).ok
    dest = {"w": torch.zeros_like(w)}
    tg.load(url, dest)
    assert torch.equal(dest["w"], w)


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.mark.parametrize("client", ["new", "old"])
@pytest.mark.parametrize("size", [1 << 10, 40 << 20], ids=["put", "multipart"])
def test_a_save_that_loses_to_an_identical_one_leaves_the_committed_checkpoint_whole(weed, monkeypatch, size, client):  # noqa: F811
    """Two saves of one step with the same bytes (a job launched twice with one seed; both save the initial weights):
    B finds the step free, then A saves it whole (committed), then B writes. B's creates get 412, and the object there,
    A's, has the ETag B's own would have (the same bytes: the same MD5), so B took it for its own (a retry whose first
    try created it) and went on; its check before the manifest found A's manifest (``ConcurrentSaveError``) and
    ``remove_own`` deleted the objects B "created" (listed with B's ETags): A's data and index. Before: A's committed
    checkpoint lost its data file (verify: missing). Now B fails and A's checkpoint verifies and loads. ``old``: a
    client without conditional writes (B writes the same bytes over A's; its removal must not take A's either)."""
    from trainguard import api

    if client == "old":
        _old_botocore(monkeypatch)
    url = _url() + "/step-000000000"
    w = torch.arange(size // 4, dtype=torch.float32)
    real = api.occupied
    calls = []

    def occupied_then_other_commits(*a, **k):
        got = real(*a, **k)
        if not calls:  # B's: the step is free; A saves the same bytes there, whole, before B writes
            calls.append(1)
            tg.save(url, {"w": w.clone()})
        return got

    monkeypatch.setattr(api, "occupied", occupied_then_other_commits)
    with pytest.raises(tg.CheckpointError):
        tg.save(url, {"w": w})  # B
    res = tg.verify(url)
    assert res.ok, res.errors
    dest = {"w": torch.zeros_like(w)}
    tg.load(url, dest)
    assert torch.equal(dest["w"], w)


def test_a_create_retried_after_a_lost_answer_is_taken_for_this_saves_own(weed, monkeypatch):  # noqa: F811
    """Each create (PutObject, CompleteMultipartUpload) is sent twice, as a client retries after an answer lost on
    the way back: the second gets 412, and the object (its metadata's token) is this call's own, no conflict."""
    import s3fs

    real = s3fs.S3FileSystem.call_s3
    again: list[str] = []

    def call(self, method, *a, **kw):  # noqa: ANN001
        out = real(self, method, *a, **kw)
        if method in ("put_object", "complete_multipart_upload") and "IfNoneMatch" in kw:
            again.append(method)
            return real(self, method, *a, **kw)  # the retry: 412, the first try having created the object
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", call)
    url = _url() + "/ckpt"
    state = {"w": torch.arange(10 << 20, dtype=torch.float32), "b": torch.ones(10)}
    tg.save(url, state)
    assert {"put_object", "complete_multipart_upload"} <= set(again)
    assert tg.verify(url).ok


def test_a_filesystem_whose_listing_gives_etags_commits_a_save(monkeypatch):
    """An fsspec filesystem other than s3fs whose listing names each object's ``ETag`` (this one: memory:// made to,
    as some stores' filesystems do): ``write_new`` records no ETag there (not S3), so the listing after the manifest
    (``samesave.recheck``) found a manifest whose ETag was not this save's "", took it for another save's, and the
    save failed with ``ConcurrentSaveError`` while its manifest stayed: every save failed, each one committed. Now a
    manifest whose ETag this save does not know is its own there; the save returns."""
    import fsspec

    mem = type(fsspec.filesystem("memory"))
    real = mem.find

    def find(self, path, *a, **kw):  # noqa: ANN001
        got = real(self, path, *a, **kw)
        if kw.get("detail"):
            return {k: {**v, "ETag": f'"{k}-{v.get("size")}"'} for k, v in got.items()}
        return got

    monkeypatch.setattr(mem, "find", find)
    url = f"memory://r54f-{uuid.uuid4().hex[:8]}/ckpt"
    tg.save(url, {"w": torch.ones(100)})
    assert tg.verify(url).ok


def test_a_409_conditional_request_conflict_is_another_save_of_the_step():
    """AWS answers 409 ``ConditionalRequestConflict`` to a conditional create when another write or delete of the key
    runs at the same time (another save of the step). Before, it was raised as the store's error: the failed save's
    cleanup (``commitfail.discard``) then removed the whole step, the other save's objects and manifest with it, as
    for any failed save. Now it is a ``ConcurrentSaveError`` (only this save's own objects go), unless the object
    there holds this create's token (then it is this call's, and the create succeeded)."""
    from botocore.exceptions import ClientError

    from trainguard.storage._exclusive import ConcurrentSaveError, create, new_token

    def conflict(**kw):  # noqa: ANN003
        err = ClientError({"Error": {"Code": "ConditionalRequestConflict", "Message": "A conflicting operation"},
                           "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject")
        raise OSError(5, "A conflicting operation occurred") from err

    class Store:
        def __init__(self, meta: dict[str, str]) -> None:
            self.meta = meta

        def call_s3(self, method: str, **kw):  # noqa: ANN003
            assert method == "head_object"
            return {"ETag": '"e"', "Metadata": self.meta}

    token = new_token()
    with pytest.raises(ConcurrentSaveError):
        create(Store({"trainguard-create": "another save's"}), "b", "k", conflict, token, {})
    assert create(Store(dict(token["Metadata"])), "b", "k", conflict, token, {}) == '"e"'
