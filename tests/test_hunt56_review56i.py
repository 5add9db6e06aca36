"""Session 56's hostile review of two changes merged that day (helper review56i).

- review56e (retention does not count a kept checkpoint whose files are cut short, grown or missing): with a policy
  that reads metadata, every kept step is a "stand-in" (``keptseen._stand_ins``), and ``kept_damaged`` held the
  files' sizes of the 16 newest kept steps only: ``KeepBest("loss", 2) | KeepEvery(2)`` read (and checked) the
  manifest of every other kept step at every save, 35-60 manifests a save at step 100-150 of a 2,000-tensor state
  (4.3-4.6 s a save where it took 0.1 s). It now looks at the 16 newest stand-ins, whose sizes it holds.
- review56a (a failed object-store save's cleanup deletes one listing's objects, ``samesave.drop_failed``;
  debris at open, ``_stale.drop_incomplete``): on a filesystem with directories (``memory://``; sftp, HDFS) the
  save's directory stayed, empty (``remove_tree`` had removed it): each retention's listing showed it ever after,
  and the open's debris listing (objects only) never did. The emptied directory now goes too. And the debris
  removal at open deleted only the objects directly under a crashed step directory: one deeper (``sub/x``) stayed,
  and each open's warning said it removed the step again (memory:// and SeaweedFS). They go with the rest now.
- ``KeepLatest(20)`` read the manifests of its 4 oldest kept steps at each save the same way.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("policy", ["best_or_every", "latest20"])
def test_retention_reads_no_manifest_of_older_kept_steps_at_each_save(tmp_path, monkeypatch, policy):
    """``KeepBest(2) | KeepEvery(2)`` keeps every even step: past 16 kept steps, each save's retention read the
    manifest of every kept step but the 16 newest (a full read and checksum each), at every save, forever;
    ``KeepLatest(20)`` those of its 4 oldest (4 a save, 1.2 MB for a 2,000-tensor state: 0.4 s a save, 0.1 s now)."""
    from trainguard.storage.local import LocalStorage

    reads: list[str] = []
    orig = LocalStorage.read_bytes

    def counted(self, path, limit):
        if path.endswith("manifest.json"):
            reads.append(path)
        return orig(self, path, limit)

    monkeypatch.setattr(LocalStorage, "read_bytes", counted)
    state = {"w": torch.arange(100.0)}
    keep = tg.KeepBest("loss", 2) | tg.KeepEvery(2) if policy == "best_or_every" else tg.KeepLatest(20)
    with tg.CheckpointManager(tmp_path / "run", keep=keep, handle_signals=False) as mgr:
        per_save = []
        for step in range(1, 49):
            reads.clear()
            mgr.save(step, state, force=True, metrics={"loss": float(step % 7)})
            per_save.append(len(reads))
    kept = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-"))
    assert len(kept) >= 20, kept  # more kept than the sizes held: the case
    assert max(per_save[-10:]) == 0, per_save  # before: 4-8 a save at steps 39-48, growing with the run


def test_retention_still_finds_a_damaged_step_among_many_kept_by_a_metadata_policy(tmp_path):
    """The bound does not blind it: the newest stand-ins are still looked at (the step before the newest cut short:
    not counted, a warning and a ``retention_damaged`` event)."""
    import json
    import os

    run = tmp_path / "run"
    state = {"w": torch.arange(50_000.0)}
    with tg.CheckpointManager(run, keep=tg.KeepBest("loss", 2) | tg.KeepEvery(2), handle_signals=False) as mgr:
        for step in range(1, 41):
            mgr.save(step, state, force=True, metrics={"loss": float(step % 7)})
        data = run / "step-000000040" / "data-00000.bin"
        os.truncate(data, data.stat().st_size // 2)
        mgr.save(41, state, force=True, metrics={"loss": 9.0})
        mgr.save(42, state, force=True, metrics={"loss": 9.0})
    with open(run / "events.jsonl") as f:
        damaged = [e["step"] for e in map(json.loads, f) if e.get("event") == "retention_damaged"]
    assert damaged == [40], damaged


def _fs():
    import fsspec

    return fsspec.filesystem("memory")


def _steps(names) -> list[str]:
    """The names that are not the run's own files (``.trainguard-run-id``, since session 58: ``runid.py``)."""
    return sorted(n for n in names if not n.startswith("."))


def test_a_failed_save_on_a_filesystem_with_directories_leaves_no_empty_step_directory(monkeypatch):
    """``memory://`` (as sftp, HDFS) has directories: the save's ``makedirs`` made ``step-000000003``; its failure's
    cleanup (``samesave.drop_failed``) deleted the objects and left the directory, which every later listing of the
    run (``listdir_dirs``, retention's) showed, and no cleanup removed."""
    from trainguard import api

    url = f"memory://review56i-{uuid.uuid4().hex[:8]}/run"
    root = "/" + url.split("://", 1)[1]
    state = {"w": torch.arange(1000.0)}
    with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, state, force=True)

    def fails(storage, work, *a, **kw):
        storage.write_atomic(storage.join(work, "data-00000.bin"), b"part of this save")
        raise OSError(5, "An error occurred (ServiceUnavailable) when calling the UploadPart operation")

    orig = api._write_rank
    monkeypatch.setattr(api, "_write_rank", fails)
    with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError):
            mgr.save(2, state, force=True)
        monkeypatch.setattr(api, "_write_rank", orig)
        assert _steps(p.rsplit("/", 1)[1] for p in _fs().ls(root, detail=False)) == ["step-000000001"]
        for step in (3, 4):
            mgr.save(step, state, force=True)
        assert _steps(mgr.storage.listdir_dirs(mgr._root)) == ["step-000000003", "step-000000004"]


def test_a_crashed_saves_directory_on_a_filesystem_with_directories_goes_at_open():
    """The open's debris removal (``commitfail.removed`` -> ``_stale.drop_incomplete``) on ``memory://``: the crashed
    save's directory goes with its objects (before: its objects went, the empty directory stayed)."""
    url = f"memory://review56i-{uuid.uuid4().hex[:8]}/run"
    root = "/" + url.split("://", 1)[1]
    state = {"w": torch.arange(1000.0)}
    with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, state, force=True)
    _fs().makedirs(f"{root}/step-000000002", exist_ok=True)  # as a save's makedirs
    _fs().pipe(f"{root}/step-000000002/data-00000.bin", b"a crashed save's data")
    with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        assert _steps(mgr.storage.listdir_dirs(mgr._root)) == ["step-000000001"]
    assert _steps(p.rsplit("/", 1)[1] for p in _fs().ls(root, detail=False)) == ["step-000000001"]


def _debris_with_a_subdirectory(url: str, pipe) -> None:
    with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.arange(1000.0)}, force=True)
    pipe("step-000000002/data-00000.bin", b"a crashed save's data")
    pipe("step-000000002/sub/x.bin", b"an object in a subdirectory (a hand copy's)")


def _opens_twice(url: str, caplog) -> list[str]:
    import logging

    said = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            with tg.CheckpointManager(url, keep=tg.KeepLatest(2), handle_signals=False):
                pass
        said.append("removed debris" in caplog.text and "step-000000002" in caplog.text)
    return said


def test_a_crashed_saves_objects_in_a_subdirectory_go_at_open_on_memory(caplog):
    """``_stale.drop_incomplete`` deleted the objects directly under the step directory (``objects``), not those
    deeper (``remove_tree`` had): they stayed forever, and every open's warning said it removed the step."""
    url = f"memory://review56i-{uuid.uuid4().hex[:8]}/run"
    root = "/" + url.split("://", 1)[1]
    _debris_with_a_subdirectory(url, lambda name, data: _fs().pipe(f"{root}/{name}", data))
    assert _opens_twice(url, caplog) == [True, False]  # before: [True, True]
    assert [k.rsplit("/", 2)[-2] for k in _fs().find(root) if not k.endswith("/.trainguard-run-id")] == ["step-000000001", "step-000000001"]


try:  # the session's SeaweedFS server (its module skips without `weed`): only the S3 test needs it
    from test_storage_s3 import weed  # noqa: F401
except pytest.skip.Exception:
    weed = None


@pytest.mark.skipif(weed is None, reason="SeaweedFS `weed` (or s3fs) not installed")
def test_a_crashed_saves_objects_in_a_subdirectory_go_at_open_on_s3(weed, monkeypatch, caplog):  # noqa: F811
    """As on ``memory://``, on SeaweedFS (the idle limit passed: ``IDLE_BOUNDS`` -1)."""
    import s3fs

    from trainguard.storage import _stale

    monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)
    key = f"tgtest/review56i-{uuid.uuid4().hex[:8]}/run"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    _debris_with_a_subdirectory(f"s3://{key}", lambda name, data: fs.pipe_file(f"{key}/{name}", data))
    assert _opens_twice(f"s3://{key}", caplog) == [True, False]
    fs.invalidate_cache()
    assert _steps(k.rsplit("/", 1)[1] for k in fs.find(key)) == ["data-00000.bin", "manifest.json"]
