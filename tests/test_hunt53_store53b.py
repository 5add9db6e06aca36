"""Hunt 53 (store53b): checkpoints on object stores, against the session's SeaweedFS server
(tests/test_storage_s3.py's ``weed`` fixture; the module skips without the ``weed`` binary)."""

from __future__ import annotations

import errno
import logging
import os
import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)
from trainguard.errors import RankFailureError, describe_error, raise_failures
from trainguard.inspect import list_checkpoints
from trainguard.storage.fsspec import FsspecStorage


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def test_retention_does_not_list_every_object_of_the_run(weed, monkeypatch):  # noqa: F811
    """Each manager save's retention listed every object of the run (a flat listing): with KeepAll, 1,100 objects
    took 0.24-0.29 s of a 0.35-0.39 s save and saves grew slower. Now it reads the step directories' names (one
    delimiter listing) and looks for a manifest only in a step directory it does not know: no flat listing of the
    run directory after the first retention."""
    url = _url()
    root = url[len("s3://"):]
    flat: list[str] = []
    orig = FsspecStorage.listdir_marked

    def spy(self, path, marker):
        flat.append(path.rstrip("/"))
        return orig(self, path, marker)

    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.ones(4)})  # the first retention (step 1's, in this save) lists every object once
        monkeypatch.setattr(FsspecStorage, "listdir_marked", spy)
        for step in range(3, 8):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        monkeypatch.undo()
    assert root not in flat, flat
    assert list_checkpoints(url) and [c.step for c in list_checkpoints(url)] == list(range(1, 8))


def test_retention_still_sees_a_checkpoint_another_process_committed(weed, caplog):  # noqa: F811
    """The shortened listing still sees what another job committed under the run directory since the last save:
    a newer step (warned about, kept) and, with KeepLatest(2), an older one is deleted as before."""
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(5, {"w": torch.ones(4)})
        mgr.save(6, {"w": torch.ones(4)})
        tg.save(f"{url}/step-000000001", {"w": torch.ones(4)})  # another writer's (its own storage, no manager)
        tg.save(f"{url}/step-000000050", {"w": torch.ones(4)})
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            mgr.save(7, {"w": torch.ones(4)})
    assert "steps 50, newer than this run's step 7" in caplog.text
    assert [c.step for c in list_checkpoints(url)] == [6, 7, 50]


def test_retention_deletes_leave_no_empty_folder_behind(weed):  # noqa: F811
    """SeaweedFS kept the emptied folder of each checkpoint retention deleted: a delimiter listing of the run
    directory still named every step ever saved. The delete now removes the folder entry too."""
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.ones(4)})
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(url[len("s3://"):], detail=False, refresh=True))
    assert [n for n in names if n != ".trainguard-run-id"] == ["step-000000004", "step-000000005"]  # the run's id: runid.py


def _leftover_then_save(url: str) -> list[str]:
    tg.save(url, {"w": torch.ones(4)})
    fs, path = FsspecStorage.from_url(url)
    return sorted(fs.listdir(path))


def test_a_crashed_saves_leftovers_do_not_stay_in_the_new_checkpoint(weed, tmp_path):  # noqa: F811
    """A plain ``tg.save`` (no manager, no debris cleanup) to a step path a crashed 2-rank save left a data object in
    wrote in place around it: the committed checkpoint held data-00001.bin beside its own files (verify OK).
    Locally the leftovers went with the rename of the temp directory; now an object store's save deletes them
    before any rank writes."""
    url = f"{_url()}/step-000000001"
    _fs().pipe_file(f"{url[len('s3://'):]}/data-00001.bin", b"old rank 1 data")
    assert _leftover_then_save(url) == ["data-00000.bin", "manifest.json"]
    assert tg.verify(url).ok

    local = tmp_path / "step-000000001"  # the same case locally: the same result
    local.mkdir()
    (local / "data-00001.bin").write_bytes(b"old rank 1 data")
    tg.save(str(local), {"w": torch.ones(4)})
    assert sorted(os.listdir(local)) == ["data-00000.bin", "manifest.json"]


def test_memory_store_leftovers_are_deleted_too():
    import fsspec

    key = f"/lo-{uuid.uuid4().hex[:8]}/step-000000003"
    fsspec.filesystem("memory").pipe_file(f"{key}/data-00002.bin", b"x")
    assert _leftover_then_save(f"memory://{key}") == ["data-00000.bin", "manifest.json"]


def _hung_upload() -> None:
    from fsspec.exceptions import FSTimeoutError

    try:
        raise FSTimeoutError()
    except FSTimeoutError as e:
        raise TimeoutError(errno.ETIMEDOUT, "the object store did not answer _put_file within 10 s "
                           "(TRAINGUARD_STORE_TIMEOUT)") from e


def test_rank_failure_text_leads_with_the_cause_not_tracebacks():
    """A rank whose upload timed out reported a full traceback (asyncio, aiobotocore...) to the others, and the
    RankFailureError's text showed it before the readable "did not answer ... within 10 s" line. Now the text gives
    each rank's readable error; ``failures`` keeps the traceback."""
    try:
        _hung_upload()
    except TimeoutError as e:
        text = describe_error(e)

    class Ctx:
        is_distributed = True

    with pytest.raises(RankFailureError) as info:
        raise_failures("save", [{"error": None}, {"error": text}], Ctx())
    msg = str(info.value)
    assert "Traceback" not in msg and "_hung_upload" not in msg, msg
    assert msg.splitlines()[:3] == ["save failed on rank(s) [1]", "--- rank 1 ---",
                                    "TimeoutError: [Errno 110] the object store did not answer _put_file within 10 s "
                                    "(TRAINGUARD_STORE_TIMEOUT)"], msg
    assert "Traceback" in info.value.failures[1] and "_hung_upload" in info.value.failures[1]


def _async_save_against_a_frozen_store(rank: int, world: int, url: str, pid: int) -> str:
    import signal

    import torch.distributed as dist

    try:
        with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=True,
                                  handle_signals=False) as mgr:
            mgr.save(1, {"w": torch.ones(4)})
            mgr.wait()
            dist.barrier()
            if rank == 0:
                os.kill(pid, signal.SIGSTOP)  # by PID: the session's server (the parent SIGCONTs it whatever happens)
            dist.barrier()
            mgr.save(2, {"w": torch.ones(4)})
            mgr.wait()
        return ""
    except RankFailureError as e:
        return str(e)
    finally:
        if rank == 0:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_an_async_multi_rank_save_against_a_hung_store_names_the_cause_first(weed, monkeypatch):  # noqa: F811
    """The repro: 2 gloo ranks, an async save with the server SIGSTOPped. The RankFailureError's text carried each
    rank's client traceback (asyncio -> aiobotocore -> ...) before the readable "did not answer ... within 3 s"."""
    import signal

    from dist_helper import run_ranks

    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env["TRAINGUARD_STORE_TIMEOUT"] = "3"
    try:
        res = run_ranks(_async_save_against_a_frozen_store, 2, _url(), weed.proc.pid, timeout=120, env=env)
    finally:
        os.kill(weed.proc.pid, signal.SIGCONT)
    for r in res:
        text = r.value
        assert "Traceback" not in text and "aiobotocore" not in text, text
        assert "within 3 s (TRAINGUARD_STORE_TIMEOUT)" in text, text
