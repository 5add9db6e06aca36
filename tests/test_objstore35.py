"""Object-store paths an audit of session 34 broke (SeaweedFS through s3fs, and memory://):

- a run directory whose name holds glob characters (``run[1]``): retention's delete expanded it
  as a pattern and removed ANOTHER run's committed checkpoint (``run1``);
- an empty ``manifest.json`` or data object: S3 answers the ranged GET 416, the client raised
  EINVAL, and restore raised it instead of falling back to the checkpoint before;
- ``tg.load`` with the endpoint down raised botocore's bare ``EndpointConnectionError``;
- ``s3://b/run//x``: SeaweedFS drops the empty segment, so saves "succeeded" and nothing was found;
- ``file://localhost/x`` and ``file:/x`` were saved under the working directory;
- a wrong secret key at a manager's open was told to make its directory writable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

import trainguard as tg

pytest.importorskip("fsspec")


def _small(v: float) -> dict:
    return {"model": {"w": torch.full((64, 64), float(v))}, "progress": tg.StateDict(step=int(v))}


def _save_steps(url: str, steps, keep) -> None:
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for s in steps:
            mgr.save(s, _small(s))


def _restores(url: str, step: int) -> None:
    back = _small(0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert mgr.restore(back) == step
    assert torch.equal(back["model"]["w"], _small(step)["model"]["w"])


def _check_glob_runs(fs, root: str, scheme: str) -> None:
    other, mine = f"{root}/run1", f"{root}/run[1]"
    _save_steps(f"{scheme}{other}", (1, 2, 3), tg.KeepAll())
    _save_steps(f"{scheme}{mine}", (1, 2, 3), tg.KeepLatest(2))  # removes run[1]'s step 1, and only that
    fs.invalidate_cache()
    for s in (1, 2, 3):  # the other run keeps every checkpoint it saved
        assert fs.exists(f"{other}/step-{s:09d}/manifest.json")
        _restores(f"{scheme}{other}", 3)
    left = sorted(k.split("/")[-2] for k in fs.find(mine) if not k.endswith("/.trainguard-run-id"))  # the run's id (runid.py)
    assert left == ["step-000000002"] * 2 + ["step-000000003"] * 2  # no debris of step 1 either
    back = _small(0)
    tg.load(f"{scheme}{other}/step-000000001", back)
    assert torch.equal(back["model"]["w"], _small(1)["model"]["w"])


def test_retention_of_a_run_named_like_a_glob_pattern_removes_only_its_own_steps_memory():
    import fsspec

    fs = fsspec.filesystem("memory")
    _check_glob_runs(fs, f"/objstore35-{uuid.uuid4().hex[:8]}", "memory://")


def test_an_empty_path_segment_is_refused_before_anything_is_written():
    import fsspec

    root = f"objstore35-{uuid.uuid4().hex[:8]}"
    with pytest.raises(tg.CheckpointError, match=rf"empty path segment.*Write memory://{root}/a/b"):
        tg.save(f"memory://{root}/a//b/step-000000001", _small(1))
    with pytest.raises(tg.CheckpointError, match="empty path segment"):
        tg.CheckpointManager(f"memory://{root}//a", handle_signals=False).open()
    assert not fsspec.filesystem("memory").exists(f"/{root}")


@pytest.mark.parametrize("spell", ["file://localhost{}", "file:{}", "file://{}"])
def test_every_spelling_of_a_file_url_is_the_absolute_path(spell, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    where = tmp_path / "ck#pt?a" / "step-000000001"  # '#' and '?' are a local name's, not a fragment or query
    tg.save(spell.format(where), _small(4))
    assert (where / "manifest.json").is_file()
    assert not any(cwd.rglob("*")), "nothing is written under the working directory"
    back = _small(0)
    tg.load(spell.format(where), back)
    assert torch.equal(back["model"]["w"], _small(4)["model"]["w"])
    with pytest.raises(tg.CheckpointError, match=r"another host \(otherhost\)"):
        tg.load(f"file://otherhost{where}", back)


# ---- on a real S3 server (SeaweedFS): tests/test_storage_s3.py's session fixture ----
s3 = pytest.importorskip("s3fs")
from test_objstore19_review import dead_endpoint  # noqa: E402
from test_storage_s3 import KEY, weed  # noqa: E402,F401  (the session's server; skips without `weed`)


def test_retention_of_a_run_named_like_a_glob_pattern_removes_only_its_own_steps_s3(weed):  # noqa: F811
    fs = s3.S3FileSystem(skip_instance_cache=True)
    _check_glob_runs(fs, f"tgtest/{uuid.uuid4().hex[:8]}", "s3://")


def test_an_empty_path_segment_on_s3_is_refused(weed):  # noqa: F811
    root = uuid.uuid4().hex[:8]
    with pytest.raises(tg.CheckpointError, match=rf"empty path segment.*Write s3://tgtest/{root}/a"):
        with tg.CheckpointManager(f"s3://tgtest/{root}//a", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            mgr.save(1, _small(1))
    fs = s3.S3FileSystem(skip_instance_cache=True)
    assert not fs.find(f"tgtest/{root}")


@pytest.mark.parametrize("which", ["manifest.json", "data-00000.bin"])
def test_an_empty_object_is_a_corrupt_checkpoint_and_restore_falls_back(weed, which, caplog):  # noqa: F811
    url = f"s3://tgtest/{uuid.uuid4().hex[:10]}"
    _save_steps(url, (1, 2), tg.KeepAll())
    fs = s3.S3FileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{url[5:]}/step-000000002/{which}", b"")  # emptied (a client that died mid-PUT of 0 bytes, a tool)
    with pytest.raises(tg.CorruptCheckpointError):
        tg.load(f"{url}/step-000000002", _small(0))
    _restores(url, 1)
    assert "checkpoint of step 2 is not usable, trying an older one" in caplog.text
    verify = subprocess.run([sys.executable, "-m", "trainguard", "verify", f"{url}/step-000000002"],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert verify.returncode == 1, verify.stdout + verify.stderr  # corrupt: 1; 2 is "could not check"


def test_load_and_save_with_the_endpoint_down_say_what_to_check(monkeypatch):
    # Nothing listening on the endpoint: tg.load raised botocore's bare EndpointConnectionError
    # (the manager's open already said what to check).
    dead_endpoint(monkeypatch)
    hint = r"the object store cannot be used \(EndpointConnectionError.*check its endpoint \(e\.g\. AWS_ENDPOINT_URL\)"
    try:
        with pytest.raises(tg.CheckpointError, match=hint):
            tg.load("s3://tgtest/any/step-000000001", _small(0))
        with pytest.raises(tg.CheckpointError, match=hint):
            tg.save("s3://tgtest/any/step-000000001", _small(1))
    finally:
        s3.S3FileSystem.clear_instance_cache()


def test_a_wrong_secret_key_is_told_to_check_the_credentials(weed, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(tg.CheckpointError, match=r"the object store refused access.*credentials") as e:
            tg.CheckpointManager(f"s3://tgtest/{uuid.uuid4().hex[:8]}", handle_signals=False).open()
        assert "writable" not in str(e.value)
        url = f"s3://tgtest/{uuid.uuid4().hex[:8]}/step-000000001"
        with pytest.raises(tg.CheckpointError, match=r"save of .* failed: .*the object store refused access.*credentials"):
            tg.save(url, _small(1))
        with pytest.raises(tg.CheckpointError, match=r"cannot read the checkpoint .*refused access.*credentials"):
            tg.load(url, _small(0))
    finally:
        s3.S3FileSystem.clear_instance_cache()
