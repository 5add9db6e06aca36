"""Hunt 55 (review55g): a hostile review of the S3 conditional creates (store55) and the young-debris rules
(review55c), against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture; the module skips
without the ``weed`` binary)."""

from __future__ import annotations

import os
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
