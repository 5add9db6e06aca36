"""Hunt 55 (review55g): a hostile review of the S3 conditional creates (store55) and the young-debris rules
(review55c), against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture; the module skips
without the ``weed`` binary)."""

from __future__ import annotations

import os
import signal
import uuid

import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _env() -> dict[str, str]:
    return {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}


def _state(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64 << 10, generator=g)}  # the same on every rank (replicated)


def _plain_save(rank: int, world: int, url: str, seed: int) -> str:
    tg.save(url, _state(seed, rank))
    return "ok"


def _save_that_meets_a_commit(rank: int, world: int, url: str, src: str) -> str:
    """Every rank saves ``url``; rank 0, right after it found the step free (``commit.occupied``), has another save's
    checkpoint (``src``'s objects, manifest last) appear there: that save committed first."""
    import s3fs

    import trainguard.api as api

    if rank == 0:
        orig = api.occupied

        def then_committed(storage, final, overwrite, **kw):
            why = orig(storage, final, overwrite, **kw)
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            names = sorted(fs.ls(src[5:]), key=lambda k: k.endswith("manifest.json"))
            for key in names:
                fs.copy(key, url[5:] + "/" + key.rsplit("/", 1)[1])
            return why

        api.occupied = then_committed
    try:
        tg.save(url, _state(2, rank))
        return "ok"
    except tg.CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def test_a_2_rank_save_that_loses_to_a_committed_one_leaves_it(weed):  # noqa: F811
    """Two 2-rank saves of one S3 step: the one that finds the step free, then every object taken by the other
    (committed meanwhile), fails on both ranks with ``ConcurrentSaveError``. Before, its rank 1, named among the
    failed ranks, removed the whole step (``remove_tree``: the manifest first) after the commit round: the winner's
    committed checkpoint was gone (its save had returned). Now the winner's checkpoint stays and verifies."""
    from dist_helper import run_ranks

    base = _url()
    src, url = base + "/a/step-000000001", base + "/b/step-000000001"
    run_ranks(_plain_save, 2, src, 1, timeout=120, env=_env())
    res = run_ranks(_save_that_meets_a_commit, 2, url, src, timeout=120, env=_env())
    got = [r.value for r in res]
    assert all(v != "ok" for v in got), got
    assert any("ConcurrentSaveError" in v or "another save" in v for v in got), got
    report = tg.verify(url)
    assert report.ok, (got, report.errors)
    run_ranks(_load_equals, 2, url, 1, timeout=120, env=_env())


def _load_equals(rank: int, world: int, url: str, seed: int) -> None:
    want = _state(seed, rank)
    got = {"w": torch.zeros_like(want["w"])}
    tg.load(url, got)
    assert torch.equal(got["w"], want["w"])


def test_verify_on_an_object_store_stops_reading_at_a_hung_endpoint(monkeypatch):
    """``tg.verify`` of a checkpoint on an object store reads 8 windows at once (verifyread). A read that fails
    with the store's ``TimeoutError`` (a hung endpoint: ``TRAINGUARD_STORE_TIMEOUT``) is raised, as the sequential
    path raises it at once. Before, every queued window was still read first (the thread pool's exit waited for
    them): one bound per 8 windows of 16 MiB (a 100 GB checkpoint: 800 bounds), and Ctrl-C went on the same way.
    Now the reads not started are not: at most those in flight when the first failed."""
    from trainguard import verifyread
    from trainguard.storage import _reads

    monkeypatch.setattr(verifyread, "WINDOW", 64 << 10)  # 64 windows from a 4 MiB checkpoint (16 MiB each, else)
    monkeypatch.setattr(verifyread, "GAP", 0)
    url = f"memory://review55g-{uuid.uuid4().hex[:8]}/ckpt"
    tg.save(url, {f"t{i}": torch.randn(16 << 10) for i in range(64)})  # 64 tensors of 64 KiB
    calls: list[int] = []

    def hung(self, buf, offset):
        calls.append(offset)
        raise TimeoutError("the object store did not answer within 600 s (TRAINGUARD_STORE_TIMEOUT)")

    monkeypatch.setattr(_reads._RangeReader, "readinto", hung)
    try:
        tg.verify(url)
    except TimeoutError:
        pass
    else:
        raise AssertionError("verify did not raise the store's TimeoutError")
    assert 1 <= len(calls) <= 2 * verifyread.THREADS, len(calls)


# (waits, sets) by (process, point), as tests/test_hunt54_store54.py's PLANS. Two saves of the same bytes (a job
# launched twice with one seed): B starts while A's data is up and takes it for a crashed save's (deletes it), then
# uploads its own, the same bytes (one ETag); A's check before its manifest finds its objects "unchanged" and
# commits; B then finds A's manifest and fails.
SAME_BYTES = ({("B", "before_occupied"): ["A_data"], ("A", "before_check"): ["B_data"],
               ("B", "before_check"): ["A_manifest"]},
              {("A", "after_data"): ["A_data"], ("B", "after_data"): ["B_data"], ("A", "after_manifest"): ["A_manifest"]})


def _saver(name: str, url: str, events: dict, out, env: dict) -> None:
    """One process's plain ``tg.save`` of ``url`` (the same state in both), paused at ``SAME_BYTES``'s points
    (bounded waits; every event is set when it ends)."""
    os.environ.update(env)
    from trainguard import api
    from trainguard.storage import _uploads

    waits, sets = SAME_BYTES

    def at(point: str) -> None:
        for ev in waits.get((name, point), []):
            events[ev].wait(60)
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
    api.check_shared = around(api.check_shared, "before_check", "after_check")
    api.commit_dir = around(api.commit_dir, "before_manifest", "after_manifest")
    _uploads._S3Upload.complete = around(_uploads._S3Upload.complete, "before_data", "after_data")
    try:
        tg.save(url, {"w": torch.arange(3 << 20, dtype=torch.float32)})  # 12 MB: a multipart upload
        out.put((name, "ok"))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((name, f"{type(e).__name__}: {e}"))
    finally:
        for ev in events.values():
            ev.set()


def test_a_save_that_loses_to_one_of_the_same_bytes_leaves_its_data(weed):  # noqa: F811
    """Two plain saves of one S3 step at once, of the same bytes. A committed (its check found the objects B
    uploaded over its own, deleted as a crashed save's, with its sizes and ETags) and returned; B then met A's
    manifest, failed, and removed "its own" objects, found by their ETags: the data A's committed manifest names.
    A's checkpoint had no data ("data file is missing"; its save had returned). Now a failed save removes nothing
    while the step holds a manifest it did not write: what is committed verifies."""
    from dist_helper import _context

    ctx = _context()
    url = _url() + "/step-000000001"
    events = {n: ctx.Event() for n in ["A_data", "B_data", "A_manifest"]}
    out = ctx.Queue()
    procs = [ctx.Process(target=_saver, args=(n, url, events, out, _env())) for n in ("A", "B")]
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
    assert [n for n, r in got.items() if r == "ok"] == ["A"], got
    assert got["B"].startswith("ConcurrentSaveError"), got
    report = tg.verify(url)
    assert report.ok, (got, report.errors)
