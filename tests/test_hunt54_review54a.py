"""Hunt 54 (review54a): hostile review of the object-store code merged in store53, store53b and review53d, looking
for data loss and interference with a live run, against the session's SeaweedFS server (tests/test_storage_s3.py's
``weed`` fixture; the S3 tests skip without the ``weed`` binary) and local disk."""

from __future__ import annotations

import logging
import os
import threading
import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)
from trainguard.inspect import list_checkpoints
from trainguard.storage import fsspec as tgfs

from conftest import run_py


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


EVAL_JOB = """
import sys, torch
import trainguard as tg
with tg.CheckpointManager(sys.argv[1], handle_signals=False) as mgr:
    print("restored", mgr.restore({"w": torch.zeros(10 << 20)}))
"""


def test_another_managers_open_does_not_abort_a_live_saves_upload(weed, monkeypatch):  # noqa: F811
    """An eval job opens a manager on the run (to restore the newest checkpoint) while the trainer's save of step 2 is
    uploading its data file. Since store53 that open aborted every multipart upload in a step directory, the live one
    too: the trainer's save failed with "NoSuchUpload" (before store53 it went on: no object of it was listed yet).
    An upload is aborted only once it has been idle for longer than a live writer can be."""
    url = _url()
    gate, reached = threading.Event(), threading.Event()
    orig = tgfs._S3Upload.part

    def part(self, k, data):  # the trainer's upload of step 2 holds after its first part went up
        orig(self, k, data)
        if k == 0 and "step-000000002" in self.key:
            reached.set()
            assert gate.wait(120)

    monkeypatch.setattr(tgfs._S3Upload, "part", part)
    state = {"w": torch.randn(10 << 20)}  # 40 MB: two parts of 32 MiB
    out: dict = {}

    def trainer_save() -> None:
        try:
            out["ok"] = mgr.save(2, state)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state)
        t = threading.Thread(target=trainer_save)
        t.start()
        try:
            assert reached.wait(120)
            res = run_py(["-c", EVAL_JOB, url], env=dict(os.environ))  # this process's PYTHONPATH: the same code
        finally:
            gate.set()
            t.join(120)
    assert res.returncode == 0 and "restored 1" in res.stdout, res.stderr[-3000:]
    assert "error" not in out, out.get("error")
    assert [(c.step, c.status) for c in list_checkpoints(url)] == [(1, "valid"), (2, "valid")]


def test_an_upload_left_young_at_open_is_aborted_by_a_later_retention(weed, monkeypatch, caplog):  # noqa: F811
    """A restart right after a crash finds the crashed save's upload young (maybe a live save's): its open leaves it.
    Once it has been idle for long enough, the first retention after that aborts it (one listing, once)."""
    from trainguard.storage import _stale

    url = _url()
    key = url[len("s3://"):]
    fs = _fs()
    uid = fs.call_s3("create_multipart_upload", Bucket="tgtest", Key=f"{key[len('tgtest/'):]}/step-000000002/data-00000.bin")
    fs.call_s3("upload_part", Bucket="tgtest", Key=f"{key[len('tgtest/'):]}/step-000000002/data-00000.bin",
               UploadId=uid["UploadId"], PartNumber=1, Body=b"x" * (5 << 20))

    def uploads() -> list[str]:
        out = fs.call_s3("list_multipart_uploads", Bucket="tgtest", Prefix=key[len("tgtest/"):] + "/")
        return [u["Key"] for u in out.get("Uploads") or []]

    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            assert len(uploads()) == 1  # young: left by the open
            mgr.save(1, {"w": torch.ones(4)})
            assert len(uploads()) == 1  # not idle for long enough yet
            monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)  # ... and now it is (a day later)
            mgr.save(2, {"w": torch.ones(4)})
            assert uploads() == []
            mgr.save(3, {"w": torch.ones(4)})
    assert "step-000000002/data-00000.bin (upload)" in caplog.text
    assert [c.step for c in list_checkpoints(url)] == [1, 2, 3]


def test_a_save_whose_upload_was_aborted_says_who_may_have(weed, monkeypatch):  # noqa: F811
    """Someone aborts the live save's upload (another job's manager after it was idle for long, a lifecycle rule): the
    save failed with "HTTP 404 (NoSuchUpload): The specified multipart upload does not exist", naming no cause."""
    url = _url()
    gate, reached, ids = threading.Event(), threading.Event(), []
    orig = tgfs._S3Upload.part

    def part(self, k, data):
        orig(self, k, data)
        if k == 0:
            ids.append((self.bucket, self.key, self._id))
            reached.set()
            assert gate.wait(120)

    monkeypatch.setattr(tgfs._S3Upload, "part", part)
    out: dict = {}

    def save() -> None:
        try:
            tg.save(url + "/ckpt", {"w": torch.randn(10 << 20)})
        except BaseException as e:  # noqa: BLE001
            out["error"] = str(e)
        finally:
            reached.set()

    t = threading.Thread(target=save)
    t.start()
    try:
        assert reached.wait(120) and ids, out
        bucket, key, uid = ids[0]
        _fs().call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=uid)
    finally:
        gate.set()
        t.join(120)
    assert "was aborted while this save was writing it" in out["error"], out
    assert "give each job its own prefix" in out["error"] and "lifecycle rule" in out["error"], out


def _drop_manifest(root: str, step: int) -> None:
    name = f"step-{step:09d}/manifest.json"
    if root.startswith("s3://"):
        _fs().rm(f"{root[len('s3://'):]}/{name}")
    elif root.startswith("memory://"):
        import fsspec

        fsspec.filesystem("memory").rm(f"{root[len('memory://'):]}/{name}")
    else:
        os.remove(os.path.join(root, name))


@pytest.mark.parametrize("where", ["s3", "local", "memory"])
def test_keepevery_keeps_one_before_the_newest_when_its_kept_multiple_went(weed, tmp_path, where):  # noqa: F811
    """KeepEvery(10) keeps one checkpoint before the newest besides its multiples (the newest may be unreadable when
    the job dies); an older kept multiple counts as that one. Step 10's manifest is deleted after a retention saw it:
    the next retention still counted it (listed on trust; review53d's check looks only at kept steps newer than what
    it deletes) and deleted step 11: one valid checkpoint left, where a manager opened afresh keeps 11 and 12."""
    url = {"s3": _url(), "local": str(tmp_path / "run"), "memory": f"memory://r{uuid.uuid4().hex[:10]}"}[where]
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepEvery(10), handle_signals=False) as mgr:
        for step in (10, 11):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        _drop_manifest(url, 10)
        mgr.save(12, {"w": torch.ones(4)})
    valid = [c.step for c in list_checkpoints(url) if c.status in ("valid", "committed")]
    assert valid == [11, 12], [(c.step, c.status) for c in list_checkpoints(url)]


def _save_with_a_file_removed(rank: int, world: int, url: str) -> dict:
    """Every rank saves; rank 0, before it writes the manifest, removes the file of a rank whose upload finished, as
    another job's manager opening on the prefix removes a save's objects (a step without a manifest: debris)."""
    import trainguard.api as api
    from trainguard.commit import rank_files

    out: dict = {}
    if rank == 0:
        orig = api.check_shared

        def removed_first(storage, work, written):
            for r in range(2, world, 2):  # not rank 0, 1 or the last (rank 2 first)
                if names := [f for f, size in rank_files(written[r]).items() if size]:
                    storage.io.rm_file(storage.join(work, names[0]))
                    out["removed"] = names[0]
                    break
            return orig(storage, work, written)

        api.check_shared = removed_first
    try:
        tg.save(url, {f"t{i}": torch.ones(1024) for i in range(64)})
    except tg.CheckpointError as e:
        out["error"] = str(e)
    return out


@pytest.mark.slow
def test_a_16_rank_save_whose_file_another_job_removed_does_not_commit(weed):  # noqa: F811
    """A manager opened by another job on the prefix removes a live save's finished objects as debris (no run lock on
    object stores). Rank 0 looked for the files of rank 0 and at most 9 other ranks before its manifest: with 16 ranks
    one of rank 2 removed went unseen, the save "succeeded" and ``tg.load`` then found "data file is missing"."""
    from dist_helper import run_ranks

    url = _url() + "/ckpt"
    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    res = run_ranks(_save_with_a_file_removed, 16, url, timeout=240, env=env)
    first = res[0].value
    assert first.get("removed", "").startswith("data-"), first
    assert f"{first['removed']}, uploaded by rank " in first.get("error", ""), first
    assert "another job using the same run directory removed it" in first["error"], first
    assert all("error" in r.value for r in res), [r.value for r in res]
    with pytest.raises(tg.CheckpointError, match="not a committed checkpoint|no such checkpoint"):
        tg.load(url, {f"t{i}": torch.zeros(1024) for i in range(64)})
