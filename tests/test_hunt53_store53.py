"""Hunt 53 (store53): checkpoints on object stores, against the session's SeaweedFS server
(tests/test_storage_s3.py's ``weed`` fixture; the module skips without the ``weed`` binary)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)

ROOT = Path(__file__).resolve().parent.parent


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _uploads(fs, key_prefix: str) -> list[str]:
    bucket, _, prefix = key_prefix.partition("/")
    out = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return sorted(u["Key"][len(prefix):] for u in out.get("Uploads") or [])


def _start_upload(fs, key: str) -> None:
    """A multipart upload with one 5 MiB part and no completion: what a save killed mid-upload leaves."""
    bucket, _, k = key.partition("/")
    uid = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=k)["UploadId"]
    fs.call_s3("upload_part", Bucket=bucket, Key=k, UploadId=uid, PartNumber=1, Body=b"x" * (5 << 20))


def test_open_aborts_the_multipart_uploads_crashed_saves_left(weed, caplog, monkeypatch):  # noqa: F811
    """A save killed mid-upload leaves an incomplete multipart upload (parts stored and billed, no object):
    the next manager's open aborted nothing before (the debris cleanup deletes objects, and none is
    listed). Now it aborts those in its step directories, and only those. (Only idle ones, since review54a:
    a live save's is left; these uploads count as idle for long, as a crash's left since the day before.)"""
    import s3fs

    from trainguard.storage import _stale

    monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)
    url = _url()
    key = url[len("s3://"):]
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    _start_upload(fs, f"{key}/step-000000002/data-00000.bin")  # the crashed save of step 2
    _start_upload(fs, f"{key}/step-000000001/data-00001.bin")  # an older crash of a step saved again since
    _start_upload(fs, f"{key}/notes/big.bin")  # not a checkpoint's: left alone
    _start_upload(fs, f"{key}-other/step-000000002/data-00000.bin")  # another run whose name starts the same
    assert len(_uploads(fs, f"{key}/")) == 3
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(url, handle_signals=False) as mgr:
            dest = {"w": torch.zeros(8)}
            assert mgr.restore(dest) == 1 and torch.equal(dest["w"], torch.ones(8))
    assert _uploads(fs, f"{key}/") == ["notes/big.bin"]
    assert _uploads(fs, f"{key}-other/") == ["step-000000002/data-00000.bin"]
    assert "step-000000002/data-00000.bin (upload)" in caplog.text


KILLED_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import trainguard as tg
    from trainguard.storage import fsspec as tgfs

    url = sys.argv[1]
    orig = tgfs._S3Upload.part

    def part(self, k, data):
        orig(self, k, data)
        if self._id is not None and STEP[0] == 2:  # a part of step 2's multipart upload is stored: killed here
            os.kill(os.getpid(), signal.SIGKILL)

    STEP = [0]
    tgfs._S3Upload.part = part
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(10 << 20)}}  # 40 MB: two parts of 32 MiB
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for step in (1, 2):
            STEP[0] = step
            mgr.save(step, state)
    """
)


@pytest.mark.slow
def test_writer_killed_mid_multipart_upload_then_resume(weed, tmp_path):  # noqa: F811
    """SIGKILL of the writer after a part of its data file went up: ``ls``/``verify`` show step 1 only,
    a restart resumes from it, its open aborts the dead upload, and the next save commits."""
    import s3fs
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    url = _url()
    key = url[len("s3://"):]
    script = tmp_path / "child.py"
    script.write_text(KILLED_CHILD)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    child = subprocess.Popen([sys.executable, str(script), url], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
    assert child.returncode == -signal.SIGKILL, err[-3000:]
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert _uploads(fs, f"{key}/") == ["step-000000002/data-00000.bin"]
    res = CliRunner().invoke(cli, ["verify", url])
    assert res.exit_code == 0 and "step-000000001" in res.output and "step-000000002" not in res.output, res.output
    torch.manual_seed(0)
    want = torch.randn(10 << 20)
    dest = {"model": {"w": torch.zeros(10 << 20)}}
    from trainguard.storage import _stale

    with pytest.MonkeyPatch.context() as mp:  # the dead upload counts as idle for long (a live one stays: review54a)
        mp.setattr(_stale, "IDLE_BOUNDS", -1.0)
        mgr = tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False).open()
    with mgr:
        assert mgr.restore(dest) == 1 and torch.equal(dest["model"]["w"], want)
        assert _uploads(fs, f"{key}/") == []
        mgr.save(2, dest)
    res = CliRunner().invoke(cli, ["verify", url])
    assert res.exit_code == 0 and res.output.count("OK") == 2, res.output


def test_a_missing_bucket_is_named_by_load_ls_and_verify(weed):  # noqa: F811
    """``trainguard ls``/``verify`` and ``tg.load`` of a URL whose bucket does not exist (a typo, the wrong
    endpoint) said only "no such directory": one looks for the prefix. Now they name the bucket."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    bucket = f"nobucket-{uuid.uuid4().hex[:8]}"
    for cmd in ("ls", "verify"):
        res = CliRunner().invoke(cli, [cmd, f"s3://{bucket}/run1"])
        assert res.exit_code == 2, res.output
        assert f"the bucket s3://{bucket} does not exist: check the bucket's name" in res.output, res.output
    with pytest.raises(tg.NotACheckpointError, match=f"the bucket s3://{bucket} does not exist"):
        tg.load(f"s3://{bucket}/run1/step-000000001", {"w": torch.zeros(2)})
    res = CliRunner().invoke(cli, ["ls", f"s3://tgtest/{uuid.uuid4().hex[:10]}"])  # the bucket is there: no hint
    assert res.exit_code == 2 and "no such directory" in res.output and "bucket" not in res.output, res.output


def test_ls_of_an_object_store_looks_at_step_directories_concurrently(monkeypatch):
    """``list_checkpoints`` (``trainguard ls``) read each checkpoint's manifest and stat'ed its files one step
    directory after another: a few requests each, 553 checkpoints took 61 s against an S3 endpoint 20 ms
    away. Now an object store's are looked at several at a time: the first manifest read here waits (at most
    5 s) for a second one to start, which only a concurrent listing does."""
    import threading

    from trainguard.inspect import list_checkpoints
    from trainguard.storage.fsspec import FsspecStorage

    url = f"memory://hunt53-ls-{uuid.uuid4().hex[:8]}"
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    lock, inflight, most, second = threading.Lock(), [0], [0], threading.Event()
    orig = FsspecStorage.read_bytes

    def read_bytes(self, path, limit):
        with lock:
            inflight[0] += 1
            most[0] = max(most[0], inflight[0])
            if inflight[0] >= 2:
                second.set()
        try:
            second.wait(5)  # bounded: sequential reads never see a second one
            return orig(self, path, limit)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(FsspecStorage, "read_bytes", read_bytes)
    rows = list_checkpoints(url)
    assert [(r.step, r.status) for r in rows] == [(1, "valid"), (2, "valid"), (3, "valid"), (4, "valid")]
    assert most[0] >= 2


class _Http403:
    status_code, headers, content, text = 403, {}, b"", ""


def _refuse(ops: tuple[str, ...]):
    """Make the process's s3fs client answer ``ops`` (e.g. ``PutObject``) with a 403 AccessDenied, as a
    read-only key or a bucket policy does; returns the function that undoes it."""
    import s3fs

    fs = s3fs.S3FileSystem()  # the instance trainguard's storage gets (fsspec's cache)
    fs.connect()

    def deny(params, **kwargs):
        return _Http403(), {"Error": {"Code": "AccessDenied", "Message": "Access Denied."},
                            "ResponseMetadata": {"HTTPStatusCode": 403}}

    for op in ops:
        fs.s3.meta.events.register(f"before-call.s3.{op}", deny)
    return lambda: [fs.s3.meta.events.unregister(f"before-call.s3.{op}", deny) for op in ops]


def test_a_save_refused_by_the_store_says_check_the_credentials(weed):  # noqa: F811
    """A save whose writes the store refuses (403: a read-only key, a bucket policy) said "PermissionError:
    the object store answered HTTP 403 (AccessDenied)", naming nothing to change; a read's 403 said "refused
    access ...: check the credentials" (docs/storage.md promises it for saves too). Now a write's says so."""
    url = _url()
    undo = _refuse(("PutObject", "CreateMultipartUpload", "UploadPart"))
    try:
        for n in (16, 3 << 20):  # one PUT; a multipart upload (12 MiB: a part of 5 MiB or more goes up as one)
            with pytest.raises(tg.CheckpointError, match=r"refused access \(Access Denied\.\): check the credentials"):
                tg.save(f"{url}/step-00000000{1 if n == 16 else 2}", {"w": torch.zeros(n)})
    finally:
        undo()


def test_debris_the_store_refuses_to_delete_is_not_reported_removed(weed, caplog, monkeypatch):  # noqa: F811
    """A manager's open whose delete of a crashed save's objects the store refused (a read-only key) logged
    "removed debris of crashed saves ...: ['step-000000005']" (and the ``debris`` event) though it stayed;
    now only the warning that it could not be removed. The next open with delete rights removes it."""
    import s3fs

    from trainguard.storage import _stale

    url = _url()
    key = url[len("s3://"):]
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{key}/step-000000005/data-00000.bin", b"partial")  # a crashed save's object
    monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)  # ... idle for long (a younger one is left: review55c)
    undo = _refuse(("DeleteObject", "DeleteObjects"))
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            with tg.CheckpointManager(url, handle_signals=False) as mgr:
                assert mgr.latest_step() == 1
    finally:
        undo()
    assert "could not remove" in caplog.text and "check the credentials" in caplog.text
    assert "removed debris" not in caplog.text
    fs.invalidate_cache()
    assert fs.exists(f"{key}/step-000000005/data-00000.bin")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(url, handle_signals=False) as mgr:
            assert mgr.latest_step() == 1
    assert "removed debris" in caplog.text and "step-000000005" in caplog.text
    fs.invalidate_cache()
    assert not fs.exists(f"{key}/step-000000005/data-00000.bin")


def test_a_rank_file_of_more_than_s3s_part_limit_goes_up_in_larger_parts(weed, monkeypatch):  # noqa: F811
    """S3 takes at most 10,000 parts in one multipart upload (SeaweedFS refuses part 10,001 too): a rank file
    over 10,000 x 32 MiB (312.5 GiB) failed at part 10,001, after 312.5 GiB went up. Now a file that needs more
    parts gets larger ones. Here the limit is lowered to 3 parts of 5 MiB for a 24 MiB file."""
    from trainguard.storage import fsspec as tgfs

    monkeypatch.setattr(tgfs, "MAX_PARTS", 3, raising=False)
    monkeypatch.setattr(tgfs.FsspecStorage.__init__, "__kwdefaults__", {"part_size": 5 << 20})
    parts: list[int] = []
    orig = tgfs._S3Upload.part

    def part(self, k, data):
        parts.append(len(data))
        return orig(self, k, data)

    monkeypatch.setattr(tgfs._S3Upload, "part", part)
    torch.manual_seed(3)
    state = {"w": torch.randn(6 << 20)}  # 24 MiB
    url = f"{_url()}/step-000000001"
    tg.save(url, state)
    assert len(parts) <= 3 and all(n % (1 << 20) == 0 for n in parts[:-1]), parts
    dest = {"w": torch.zeros(6 << 20)}
    tg.load(url, dest)
    assert torch.equal(dest["w"], state["w"])


def test_a_url_scheme_in_capitals_is_the_same_store():
    """URL schemes are case-insensitive: ``MEMORY://...`` (``S3://...``) was refused with "no fsspec filesystem
    for this URL (Protocol not known: MEMORY). Install the package for the scheme", with the package installed."""
    run = f"hunt53-scheme-{uuid.uuid4().hex[:8]}"
    tg.save(f"MEMORY://{run}/step-000000001", {"w": torch.full((3,), 7.0)})
    dest = {"w": torch.zeros(3)}
    tg.load(f"memory://{run}/step-000000001", dest)
    assert dest["w"].tolist() == [7.0, 7.0, 7.0]
    assert tg.verify(f"Memory://{run}/step-000000001").ok


def test_an_s3_url_in_capitals_is_the_same_store(weed):  # noqa: F811
    url = _url()
    tg.save(f"S3://{url[len('s3://'):]}/step-000000001", {"w": torch.full((3,), 5.0)})
    dest = {"w": torch.zeros(3)}
    tg.load(f"{url}/step-000000001", dest)
    assert dest["w"].tolist() == [5.0, 5.0, 5.0]
