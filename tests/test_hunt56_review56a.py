"""Hunt 56 (review56a): a hostile review of the failure and cleanup paths of saves on object stores
(``commitfail.discard``/``discard_late``, ``samesave``, ``_stale``). On ``memory://`` (fast) and, where the path
needs the store's answers, on the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture)."""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg

try:  # the session's SeaweedFS server (its module skips without `weed`): only the S3 tests need it
    from test_storage_s3 import weed  # noqa: F401
except pytest.skip.Exception:
    weed = None
needs_weed = pytest.mark.skipif(weed is None, reason="SeaweedFS `weed` (or s3fs) not installed")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16 << 10, generator=g), "b": torch.randn(300, generator=g)}


def _copy_step(src: str, dst: str) -> None:
    """Another save's checkpoint appears at ``dst`` (``src``'s objects, manifest last): it committed there."""
    import fsspec

    fs = fsspec.filesystem("memory")
    keys = sorted(fs.find(src.split("://", 1)[1]), key=lambda k: k.endswith("manifest.json"))
    for k in keys:
        fs.copy(k, dst.split("://", 1)[1] + "/" + k.rsplit("/", 1)[1])


def _loads(url: str, seed: int) -> bool:
    want = _state(seed)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    tg.load(url, got)
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("when", ["before_failure", "after_failure"])
def test_a_save_failing_for_another_reason_leaves_a_checkpoint_committed_meanwhile(monkeypatch, when):
    """Two saves of one step on an object store: B commits while A is writing; A then fails for a reason of its own
    (its upload's error: a 503, a refused endpoint, a full quota), not by meeting B's objects. Before, A's cleanup
    (``commitfail.discard``, rank 0) removed the whole step, manifest first (``remove_tree``): B's committed
    checkpoint, whose save had returned, was gone. Now a failed save never removes a manifest it did not write, nor
    an object that manifest names; what A left beside it (not named) goes."""
    from trainguard import api, commitfail

    base = f"memory://review56a-{uuid.uuid4().hex[:8]}"
    src, url = f"{base}/a/step-000000001", f"{base}/b/step-000000001"
    tg.save(src, _state(1))
    orig = api._write_rank

    def fails_while_another_commits(storage, work, *a, **kw):
        storage.write_atomic(storage.join(work, "data-00009.bin"), b"debris of this save")  # A's own, unnamed by B
        if when == "before_failure":
            _copy_step(src, url)
            raise OSError("An error occurred (SlowDown) when calling the UploadPart operation: reduce your request rate")
        raise OSError("An error occurred (ServiceUnavailable) when calling the UploadPart operation")

    monkeypatch.setattr(api, "_write_rank", fails_while_another_commits)
    if when == "after_failure":  # B commits after A's upload failed, before A's cleanup
        orig_discard = commitfail.discard

        def late(storage, work, *a, **kw):
            _copy_step(src, url)
            return orig_discard(storage, work, *a, **kw)

        monkeypatch.setattr(api, "discard", late)
    with pytest.raises(tg.CheckpointError):
        tg.save(url, _state(2))
    monkeypatch.setattr(api, "_write_rank", orig)
    report = tg.verify(url)
    assert report.ok, report.errors
    assert _loads(url, 1)
    import fsspec

    names = sorted(k.rsplit("/", 1)[1] for k in fsspec.filesystem("memory").find(url.split("://", 1)[1]))
    assert "data-00009.bin" not in names, names  # A's own leftover, not B's, is removed


@needs_weed
def test_the_s3_fixture_refuses_a_server_that_is_not_its_own(weed, tmp_path):  # noqa: F811
    """The ``weed`` fixture's ``Weed.start`` took any S3 server's answer on its port for its own process's: a server
    whose port another took (another pytest's server, after this one's restart freed it; found by reading why
    objstore19's frozen-endpoint test once saw its save commit) died of "address already in use", and start()
    returned "ready" anyway: every server used one secret key. The tests then talked to the other server, and a
    freeze or kill by PID hit the dead process (a SIGSTOP of a zombie succeeds): the hung endpoint's save committed.
    Now each server has its own secret, the probe uses it, and a start whose process died raises ``WeedExited``."""
    from test_storage_s3 import Weed, WeedExited

    other = Weed(tmp_path / "other")
    other.ports = dict(weed.ports)  # the session's server holds these: this one cannot bind them
    try:
        with pytest.raises(WeedExited):
            other.start(timeout=40)
    finally:
        other.kill()
    assert weed.proc is not None and weed.proc.poll() is None


def _half_step(base: str) -> tuple[str, str]:
    """``base/run``'s step 1 committed, step 2 holding a save's data without its manifest (a save in progress, its
    rank 0 waiting for another rank); and ``base/src/step-000000002``, that save's checkpoint once committed."""
    import fsspec

    run, src = f"{base}/run", f"{base}/src/step-000000002"
    tg.save(f"{run}/step-000000001", _state(1))
    tg.save(src, _state(2))
    fs = fsspec.filesystem("memory")
    for k in fs.find(src.split("://", 1)[1]):
        if not k.endswith("manifest.json"):
            fs.copy(k, f"{run.split('://', 1)[1]}/step-000000002/{k.rsplit('/', 1)[1]}")
    return run, src


def _commits_during(src: str, step_dir: str):
    """An ``active`` (the idle check) during which the save of ``step_dir`` commits (its manifest goes up)."""
    import fsspec

    def active(storage, path):
        if path.rstrip("/").endswith("step-000000002"):
            fsspec.filesystem("memory").copy(f"{src.split('://', 1)[1]}/manifest.json",
                                             f"{step_dir.split('://', 1)[1]}/manifest.json")
        return False

    return active


def test_a_manager_open_leaves_a_step_that_a_save_commits_while_it_looks_at_it(monkeypatch):
    """A manager's open (``clean_debris``, rank 0) finds step 2 without a manifest (another job's save, waiting for
    a rank) and asks whether it is idle (``_stale.active``: listings of its objects, uploads and parts); the save
    commits meanwhile. Before, ``remove_tree`` then deleted the step, manifest first: a checkpoint whose save had
    returned was gone. Now the objects of one listing taken after that check go, unless it shows a manifest."""
    from trainguard import commitfail

    base = f"memory://review56a-{uuid.uuid4().hex[:8]}"
    run, src = _half_step(base)
    monkeypatch.setattr(commitfail, "active", _commits_during(src, f"{run}/step-000000002"))
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.latest_step() == 2
    assert tg.verify(f"{run}/step-000000002").ok
    assert _loads(f"{run}/step-000000002", 2)


def test_a_second_look_at_a_young_step_leaves_it_when_a_save_commits_it_meanwhile(monkeypatch):
    """``_stale.recheck`` (retention, rank 0): a step directory the open left (written to within the idle limit)
    is looked at again; it has no manifest, then its save commits while ``active`` lists it. Before, it was
    removed (``remove_tree``: the new manifest first). Now it stays."""
    import time

    from trainguard.storage import _stale, for_path

    base = f"memory://review56a-{uuid.uuid4().hex[:8]}"
    run, src = _half_step(base)
    storage, root = for_path(run)
    step2 = storage.join(root, "step-000000002")
    storage._dirs_left = {root: {step2}}  # as ``active`` records a young directory at the open
    storage._uploads_opened = {root: time.monotonic() - 1e6}  # that long ago
    monkeypatch.setattr(_stale, "active", _commits_during(src, f"{run}/step-000000002"))
    monkeypatch.setattr(_stale, "abort_uploads", lambda storage, root: [])  # S3 only
    assert _stale.recheck(storage, root) == []
    assert tg.verify(f"{run}/step-000000002").ok
    assert _loads(f"{run}/step-000000002", 2)


def test_a_crashed_saves_step_is_still_removed_by_the_open():
    """What the narrowing keeps: a step without a manifest, idle, goes at the open (every object of it)."""
    import fsspec

    base = f"memory://review56a-{uuid.uuid4().hex[:8]}"
    run, _src = _half_step(base)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.latest_step() == 1
    assert not fsspec.filesystem("memory").exists(f"{run.split('://', 1)[1]}/step-000000002/data-00000.bin")


@needs_weed
def test_on_s3_a_save_whose_upload_fails_leaves_the_checkpoint_another_save_committed(weed, monkeypatch):  # noqa: F811
    """Lead 1 on SeaweedFS: A's part upload fails (the store's 503) after B committed the step (B's objects, manifest
    last, appear once A found the step free). Before, A's cleanup deleted B's manifest and objects; now B verifies
    and loads."""
    import s3fs

    from trainguard import api
    from trainguard.storage import _uploads

    base = f"s3://tgtest/review56a-{uuid.uuid4().hex[:8]}"
    src, url = f"{base}/a/step-000000001", f"{base}/b/step-000000001"
    big = {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))}  # 12 MiB: a multipart upload
    tg.save(src, big)
    orig = api.occupied

    def then_committed(storage, final, overwrite, **kw):
        why = orig(storage, final, overwrite, **kw)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for key in sorted(fs.find(src[5:]), key=lambda k: k.endswith("manifest.json")):
            fs.copy(key, url[5:] + "/" + key.rsplit("/", 1)[1])
        return why

    def refused(self, k, data):
        raise OSError("An error occurred (ServiceUnavailable) when calling the UploadPart operation: Please reduce "
                      "your request rate")

    monkeypatch.setattr(api, "occupied", then_committed)
    monkeypatch.setattr(_uploads._S3Upload, "part", refused)
    monkeypatch.setattr(_uploads, "PART_SIZE_MIN_MULTIPART", 0)  # every part goes through upload_part
    with pytest.raises(tg.CheckpointError, match="ServiceUnavailable"):
        tg.save(url, {"w": torch.zeros(3 << 20)})
    monkeypatch.undo()
    report = tg.verify(url)
    assert report.ok, report.errors
    got = {"w": torch.zeros(3 << 20)}
    tg.load(url, got)
    assert torch.equal(got["w"], big["w"])
