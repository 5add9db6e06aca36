"""Hunt 54 (store54): object stores, against the session's SeaweedFS server (tests/test_storage_s3.py's
``weed`` fixture; the module skips without the ``weed`` binary)."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)

from dist_helper import _context


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _tensor(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3 << 20)  # 12 MB: a multipart upload of one part


# --- 1. two plain tg.save calls of one S3 step at once (two processes) -------------------------------

# (waits, sets) by (process, point): a process waits for the events named at a point, then sets those named.
PLANS = {
    # both find the step free; A's data, B's data, B's manifest, A's manifest. Before: both returned, and the step
    # held A's manifest over B's data (verify: checksum mismatch).
    "manifest_last": ({("A", "before_data"): ["B_free"], ("B", "before_data"): ["A_data"],
                       ("A", "before_manifest"): ["B_manifest"]},
                      {("B", "after_occupied"): ["B_free"], ("A", "after_data"): ["A_data"],
                       ("B", "after_manifest"): ["B_manifest"]}),
    # A commits; then B, which found the step free before A wrote, uploads over A's data. Before: both returned,
    # A's committed checkpoint was replaced after its save returned.
    "late_data": ({("A", "before_data"): ["B_free"], ("B", "before_data"): ["A_manifest"]},
                  {("B", "after_occupied"): ["B_free"], ("A", "after_manifest"): ["A_manifest"]}),
    # B starts while A's data is up and its manifest not yet: B takes A's objects for a crashed save's and deletes
    # them. Before: both returned (A's checkpoint was B's data).
    "leftovers": ({("B", "before_occupied"): ["A_data"], ("A", "before_manifest"): ["B_data"]},
                  {("A", "after_data"): ["A_data"], ("B", "after_data"): ["B_data"]}),
}


def _saver(name: str, url: str, seed: int, plan: str, events: dict, out, env: dict) -> None:
    """One process's plain ``tg.save`` of ``url``, paused at the points ``PLANS[plan]`` names (bounded waits).
    ``env``: the test's AWS_* variables. A forkserver child has the environment the forkserver started with (maybe
    before the ``weed`` fixture set them, or with another server's): the save must go to the server the test reads."""
    os.environ.update(env)
    from trainguard import api
    from trainguard.storage import _uploads

    waits, sets = PLANS[plan]

    def at(point: str) -> None:
        for ev in waits.get((name, point), []):
            events[ev].wait(60)  # bounded; the other process sets every event when it ends
        for ev in sets.get((name, point), []):
            events[ev].set()

    def around(fn, before, after):
        def call(*a, **k):
            at(before)
            try:
                return fn(*a, **k)
            finally:
                at(after)
        return call

    api.occupied = around(api.occupied, "before_occupied", "after_occupied")
    api.commit_dir = around(api.commit_dir, "before_manifest", "after_manifest")
    _uploads._S3Upload.complete = around(_uploads._S3Upload.complete, "before_data", "after_data")
    try:
        tg.save(url, {"w": _tensor(seed)})
        out.put((name, "ok"))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((name, f"{type(e).__name__}: {e}"))
    finally:
        for ev in events.values():
            ev.set()


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_two_saves_of_one_s3_step_at_once_never_both_return(weed, plan):  # noqa: F811
    """Two processes save the same step directory at once, their steps interleaved as ``plan`` says. Before, both
    returned in each plan, and in ``manifest_last`` the step held one save's manifest over the other's data. Now at
    most one returns; the other raises ``ConcurrentSaveError``; what is committed verifies and loads as the state
    of the save that returned; with none returned, no manifest is there."""
    ctx = _context()
    url = _url() + "/step-000000001"
    events = {n: ctx.Event() for n in ["A_free", "B_free", "A_data", "B_data", "A_manifest", "B_manifest"]}
    out = ctx.Queue()
    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    procs = [ctx.Process(target=_saver, args=(n, url, seed, plan, events, out, env)) for n, seed in (("A", 1), ("B", 2))]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    returned = [n for n, r in got.items() if r == "ok"]
    assert len(returned) <= 1, got
    for r in got.values():
        if r != "ok":
            assert r.startswith("ConcurrentSaveError: ") and ("another save" in r or "another job" in r), got
    res = tg.verify(url)
    if returned:
        assert res.ok, (got, res.errors)
        dest = {"w": torch.zeros(3 << 20)}
        tg.load(url, dest)
        assert torch.equal(dest["w"], _tensor(1 if returned == ["A"] else 2)), got
    else:
        assert not _fs().exists(url[len("s3://"):] + "/manifest.json"), got


def test_a_file_of_another_save_in_the_step_is_not_committed_with_it(weed, monkeypatch):  # noqa: F811
    """Another save's object (its rank 1's data file) appears in the step while this 1-rank save writes. Before, the
    manifest was written beside it: a step holding files of both saves that verified OK. Now the save fails with
    ``ConcurrentSaveError`` naming it, leaves the other's object, and removes its own."""
    from trainguard import api

    url = _url() + "/step-000000001"
    key = url[len("s3://"):]
    fs = _fs()
    check = api.check_shared

    def planted(storage, work, written):
        fs.pipe_file(f"{key}/data-00001.bin", b"another save's rank 1")
        return check(storage, work, written)

    monkeypatch.setattr(api, "check_shared", planted)
    with pytest.raises(tg.CheckpointError, match="data-00001.bin, which this save did not write") as e:
        tg.save(url, {"w": _tensor(3)})
    assert type(e.value).__name__ == "ConcurrentSaveError"
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(key)) == ["data-00001.bin"]


# --- 2. tg.save to a bucket's root ------------------------------------------------------------------------------


def test_a_plain_save_to_a_bucket_root_is_refused_and_writes_nothing(weed):  # noqa: F811
    """``tg.save("s3://bucket", state)``: the save took the bucket's key prefix for "/bucket/" and found nothing
    there, so a second save went in place over the committed checkpoint (both returned) and a failed one's objects
    stayed. Now refused before a byte is written, saying to give a prefix; a manager's run directory may still be
    the bucket's root."""
    fs = _fs()
    bucket = f"tgroot{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    try:
        for _ in range(2):
            with pytest.raises(tg.CheckpointError, match=rf"s3://{bucket} is the root of a bucket: a checkpoint needs "
                               rf"a prefix of its own. Save to s3://{bucket}/<name>"):
                tg.save(f"s3://{bucket}", {"w": _tensor(4)})
            fs.invalidate_cache()
            assert fs.find(bucket) == []
        with tg.CheckpointManager(f"s3://{bucket}", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            mgr.save(1, {"w": _tensor(4)})
        assert tg.verify(f"s3://{bucket}/step-000000001").ok
    finally:
        fs.rm(bucket, recursive=True)


# --- 3. verify on an object store: several reads at once, the same result --------------------------------------


def _corrupt(fs, key: str, offsets: list[int]) -> None:
    data = bytearray(fs.cat_file(key))
    for o in offsets:
        data[o] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def test_verify_on_s3_reads_several_at_once_and_reports_what_one_at_a_time_did(weed, monkeypatch):  # noqa: F811
    """``tg.verify`` of an S3 checkpoint read its chunks one after another (4,000 tensors of 16 KiB: 4,000 GETs,
    30-49 s on loopback). Now several reads are in flight at once (two reads meet at a barrier; before, the first
    waited alone), and the result (errors, their order, bytes checked) is the one the one-at-a-time path gives,
    for flipped bytes in small and large tensors and for reads that fail."""
    from trainguard.commit import read_manifest
    from trainguard.storage import for_path
    from trainguard.storage.fsspec import FsspecStorage

    torch.manual_seed(5)
    state = {f"s{i:03d}": torch.randn(4096) for i in range(300)}
    state["big"] = torch.randn(5 << 20)  # 20 MiB: over one read's window, in pieces
    url = _url() + "/ckpt"
    tg.save(url, state)
    fs = _fs()
    key = url[len("s3://"):]
    manifest = read_manifest(*for_path(url))
    where = {p: e.chunks[0] for p, e in manifest.tensors.items()}
    files = sorted({c.file for c in where.values()})
    for f in files:  # a flipped byte in 3 small tensors and in the big one's last 4 MiB block
        hits = [c.offset + 100 for p, c in where.items() if c.file == f and p in ("s007", "s150", "s299")]
        hits += [where["big"].offset + where["big"].length - 10] if where["big"].file == f else []
        _corrupt(fs, f"{key}/{f}", hits)

    storage, target = for_path(url)
    reader = type(storage.open_read(storage.join(target, files[0])))  # the object store's reader class
    barrier, met = threading.Barrier(2), []
    orig = reader.readinto

    def readinto(self, buf, offset):
        if not met:
            try:
                barrier.wait(20)  # bounded: the first two reads in flight meet here
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return orig(self, buf, offset)

    monkeypatch.setattr(reader, "readinto", readinto)
    got = tg.verify(url)
    assert met and met[0], "the reads of verify went one at a time"
    monkeypatch.setattr(reader, "readinto", orig)
    monkeypatch.setattr(FsspecStorage, "atomic_rename", True)  # verify's one-at-a-time path (a local disk's)
    want = tg.verify(url)
    assert not want.ok and len(want.errors) == 4, want.errors
    assert (got.ok, got.errors, got.bytes_checked, got.step) == (want.ok, want.errors, want.bytes_checked, want.step)

    def failing(self, buf, offset):  # a read that covers s150's first byte fails, naming the read
        c = where["s150"]
        if offset <= c.offset < offset + len(buf):
            raise tg.CorruptCheckpointError(f"read of {len(buf)} bytes at {offset} failed")
        return orig(self, buf, offset)

    monkeypatch.setattr(reader, "readinto", failing)
    want = tg.verify(url)
    monkeypatch.setattr(FsspecStorage, "atomic_rename", False)
    got = tg.verify(url)
    assert any("read of 16384 bytes at" in e for e in want.errors), want.errors
    assert (got.ok, got.errors, got.bytes_checked) == (want.ok, want.errors, want.bytes_checked)
