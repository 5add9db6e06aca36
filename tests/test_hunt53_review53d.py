"""Hunt 53 (review53d): hostile review of the object-store retention and cleanup merged in store53/store53b,
against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture) and local disk."""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)
from trainguard.inspect import list_checkpoints


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _drop_manifest(root: str, step: int) -> None:
    name = f"step-{step:09d}/manifest.json"
    if root.startswith("s3://"):
        _fs().rm(f"{root[len('s3://'):]}/{name}")
    elif root.startswith("memory://"):
        import fsspec

        fsspec.filesystem("memory").rm(f"{root[len('memory://'):]}/{name}")
    else:
        import os

        os.remove(os.path.join(root, name))


@pytest.mark.parametrize("where", ["s3", "local", "memory"])
def test_a_step_whose_manifest_went_is_not_counted_among_those_kept(weed, tmp_path, where):  # noqa: F811
    """KeepLatest(2): the newest kept checkpoint's manifest is deleted (by hand, by another process's cleanup) after
    the manager's retention saw it. The next retention counted that broken step as one of the 2 it keeps (it did not
    look again at names it had seen) and deleted the older good one: one valid checkpoint left of the 2 asked for.
    Before store53 an object store's retention listed every object and saw it; local disk never looked again."""
    url = {"s3": _url(), "local": str(tmp_path / "run"), "memory": f"memory://r{uuid.uuid4().hex[:10]}"}[where]
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        _drop_manifest(url, 3)
        mgr.save(4, {"w": torch.ones(4)})
    valid = [c.step for c in list_checkpoints(url) if c.status in ("valid", "committed")]
    assert valid == [2, 4], [(c.step, c.status) for c in list_checkpoints(url)]


@pytest.mark.parametrize("where", ["s3", "local"])
def test_keepbest_does_not_count_a_best_step_whose_manifest_went(weed, tmp_path, where):  # noqa: F811
    """KeepBest(2) by loss: the best step's manifest is deleted after a retention saw it. It kept its place among
    the 2 best (its metric is remembered), and the next save deleted step 3, which it should keep."""
    url = _url() if where == "s3" else str(tmp_path / "run")
    keep = tg.KeepBest("loss", n=2, mode="min")
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.ones(4)}, metrics={"loss": float(step)})
        _drop_manifest(url, 1)
        mgr.save(4, {"w": torch.ones(4)}, metrics={"loss": 4.0})
    valid = [c.step for c in list_checkpoints(url) if c.status in ("valid", "committed")]
    assert valid == [2, 3, 4], [(c.step, c.status) for c in list_checkpoints(url)]


def test_remove_tree_of_a_bucket_root_deletes_its_objects(weed, caplog):  # noqa: F811
    """remove_tree of a whole bucket (a checkpoint saved at s3://bucket): the emptied-folder key appended to the
    delete was "" there, which botocore refuses (ParamValidationError), so nothing was deleted, with a warning."""
    from trainguard.storage.fsspec import FsspecStorage

    fs = _fs()
    bucket = f"tgroot{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/data-00001.bin", b"x")
    fs.pipe(f"{bucket}/data-00002.bin", b"y")
    storage, path = FsspecStorage.from_url(f"s3://{bucket}")
    storage.remove_tree(path)
    assert storage.listdir(path) == [], caplog.text
    assert fs.exists(bucket)  # the bucket itself stays
