"""Hunt 54 (review54d): hostile review of review54a's merge (idle-upload aborts, ``_all_listed``, ``kept_gone``),
against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture; the S3 tests skip without the
``weed`` binary), local disk and ``memory://``."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)
from trainguard.inspect import list_checkpoints


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _drop_manifest(root: str, step: int) -> None:
    name = f"step-{step:09d}/manifest.json"
    if root.startswith("s3://"):
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).rm(f"{root[len('s3://'):]}/{name}")
    elif root.startswith("memory://"):
        import fsspec

        fsspec.filesystem("memory").rm(f"{root[len('memory://'):]}/{name}")
    else:
        os.remove(os.path.join(root, name))


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_keepevery_keeps_one_before_the_newest_when_two_kept_multiples_went(weed, tmp_path, where):  # noqa: F811
    """KeepEvery(10) keeps its multiples and one checkpoint before the newest; an older kept multiple counts as that
    one. Steps 10 and 20 lose their manifests after a retention saw them (a bucket lifecycle rule expiring old
    objects takes several at once). review54a's check HEADs the newest kept step before the newest (20: gone) and
    lists again, but that second pass trusted step 10 without a look: it counted as the one before the newest and
    step 21 was deleted, leaving one valid checkpoint where a manager opened afresh keeps 21 and 22."""
    url = {"s3": _url(), "local": str(tmp_path / "run"), "memory": f"memory://r{uuid.uuid4().hex[:10]}"}[where]
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepEvery(10), handle_signals=False) as mgr:
        for step in (10, 20, 21):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        _drop_manifest(url, 10)
        _drop_manifest(url, 20)
        mgr.save(22, {"w": torch.ones(4)})
    valid = [c.step for c in list_checkpoints(url) if c.status in ("valid", "committed")]
    assert valid == [21, 22], [(c.step, c.status) for c in list_checkpoints(url)]


def test_a_bucket_deleted_during_a_save_is_not_told_as_an_aborted_upload(weed, monkeypatch):  # noqa: F811
    """review54a words a 404 to a part or the completion as "the upload ... was aborted ... by a CheckpointManager
    opened on this run directory by another job ..., or by a bucket lifecycle rule". The bucket deleted while the save
    was uploading answers 404 too (NoSuchBucket), and the save said "HTTP 404 (NoSuchBucket): the upload of ... was
    aborted while this save was writing it: by a CheckpointManager ...": a cause that did not happen, and a change
    (own prefix, a lifecycle rule) that does not help.

    No request is in flight while the bucket is deleted: the second part waits until then. Before, it could go up
    beside the delete, and SeaweedFS, sent a part during a bucket's deletion, answers NoSuchUpload and has the bucket
    again afterwards (6 of 6 probes: listed and HEAD 200 2 s after ``delete_bucket`` returned), so the save was right
    to tell an aborted upload. Under load that race was met (1 run in ~15 with 3 busy loops; 2 fresh-clone CI runs
    failed in session 56)."""
    import threading

    import s3fs

    from trainguard.storage import fsspec as tgfs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"tg54d{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    gate, reached = threading.Event(), threading.Event()
    orig = tgfs._S3Upload.part

    def part(self, k, data):  # the first part goes up, then the bucket is deleted, then the others go up
        if k > 0:
            assert gate.wait(120)
        orig(self, k, data)
        if k == 0:
            reached.set()

    monkeypatch.setattr(tgfs._S3Upload, "part", part)
    out: dict = {}

    def save() -> None:
        try:
            tg.save(f"s3://{bucket}/ckpt", {"w": torch.randn(10 << 20)})  # 40 MB: two parts of 32 MiB
        except BaseException as e:  # noqa: BLE001
            out["error"] = str(e)
        finally:
            reached.set()

    t = threading.Thread(target=save)
    t.start()
    try:
        assert reached.wait(120), out
        fs.call_s3("delete_bucket", Bucket=bucket)  # SeaweedFS deletes it with its objects and uploads
    finally:
        gate.set()
        t.join(120)
    assert f"the bucket {bucket} was deleted while this save was writing" in out["error"], out
    assert "was aborted" not in out["error"], out


def _save_to_own_prefix(rank: int, world: int, url: str) -> dict:
    """Each rank saves under a prefix of its own (a URL made from the host name): rank 1's file never reaches the
    directory rank 0 commits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.arange(4096.0), init_device_mesh("cpu", (world,)), [Shard(0)])  # a shard each
    try:
        tg.save(f"{url}/node{rank}/ckpt", {"w": w})
    except tg.CheckpointError as e:
        return {"error": str(e)}
    return {}


def test_a_rank_saving_to_another_prefix_is_not_told_as_another_jobs_removal(weed):  # noqa: F811
    """On object stores rank 0 looks for every rank's files in one listing (review54a). A rank that saved to another
    prefix (the begin round compares only the path's last part) failed the save with "data-00001.bin, uploaded by
    rank 1 into <rank 0's directory> in this save, is gone before its manifest was written: another job using the
    same run directory removed it ...": a place it was never uploaded to, and a cause that did not happen. Before
    review54a it said the ranks must share the run directory; now both causes are named."""
    from dist_helper import run_ranks

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    res = run_ranks(_save_to_own_prefix, 2, _url(), timeout=120, env=env)
    err = res[0].value.get("error", "")
    assert "data-00001.bin, uploaded by rank 1" in err, res[0].value
    assert "rank 1 saved it elsewhere: every rank must pass the same URL" in err, err
    assert all("error" in r.value for r in res), [r.value for r in res]


def test_an_open_with_a_shorter_store_timeout_does_not_abort_a_live_saves_upload(weed, monkeypatch):  # noqa: F811
    """review54a aborts an upload at a manager's open once nothing of it happened for twice the *opener's*
    TRAINGUARD_STORE_TIMEOUT, as a live writer's every call ends within one. But the bound that holds a live
    writer is the writer's own: an eval job run with TRAINGUARD_STORE_TIMEOUT=1 (fail fast) opened on the run while
    the trainer (the default 600 s bound) had a part going up for a few seconds, and aborted the trainer's upload:
    that save failed ("was aborted while this save was writing it"). The idle time is now at least twice the
    default bound, whatever the opener's."""
    import threading
    from email.utils import parsedate_to_datetime

    import s3fs

    from trainguard.storage import fsspec as tgfs

    url = _url()
    gate, reached, ids = threading.Event(), threading.Event(), []
    orig = tgfs._S3Upload.part

    def part(self, k, data):  # the trainer's second part is slow: held until the eval job opened
        if k == 1 and "step-000000002" in self.key:
            ids.append((self.bucket, self.key, self._upload_id()))
            reached.set()
            assert gate.wait(120)
        orig(self, k, data)

    monkeypatch.setattr(tgfs._S3Upload, "part", part)
    state = {"w": torch.randn(10 << 20)}  # 40 MB: two parts of 32 MiB
    out: dict = {}

    def trainer_save() -> None:
        try:
            out["ok"] = mgr.save(2, state)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state)
        t = threading.Thread(target=trainer_save)
        t.start()
        try:
            assert reached.wait(120), out
            bucket, key, uid = ids[0]
            for _ in range(600):  # the store's clock 3 s past the upload's last part (part 2 going up that long)
                page = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=uid)
                now = parsedate_to_datetime(page["ResponseMetadata"]["HTTPHeaders"]["date"])
                if page.get("Parts") and (now - max(p["LastModified"] for p in page["Parts"])).total_seconds() >= 3:
                    break
                threading.Event().wait(0.1)
            monkeypatch.setenv("TRAINGUARD_STORE_TIMEOUT", "1")  # the eval job's bound (read when its storage is built)
            with tg.CheckpointManager(url, handle_signals=False):
                pass
            monkeypatch.delenv("TRAINGUARD_STORE_TIMEOUT")
        finally:
            gate.set()
            t.join(120)
    assert "error" not in out, out.get("error")
    assert [(c.step, c.status) for c in list_checkpoints(url)] == [(1, "valid"), (2, "valid")]
