"""Review of the object-store paths after the media-error changes: each test reproduces a bug found there."""

from __future__ import annotations

import uuid

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main

pytest.importorskip("s3fs")
from botocore.exceptions import ClientError  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402
from s3fs.errors import translate_boto_error  # noqa: E402

from conftest import filled_linear as _model  # noqa: E402


def _s3_error(code: str, status: int, op: str) -> OSError:
    """What s3fs raises for an HTTP error it has no mapping for: OSError(EIO) (its own translation)."""
    return translate_boto_error(ClientError({"Error": {"Code": code, "Message": "passing"},
                                             "ResponseMetadata": {"HTTPStatusCode": status}}, op))


def _run_of_three() -> str:
    url = f"memory://objstore14-{uuid.uuid4().hex[:8]}"
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"model": _model(float(s))})
    return url


@pytest.mark.parametrize("which, code, status", [("manifest.json", "502", 502), ("data-", "SlowDownRead", 503)])
def test_a_passing_object_store_error_at_restart_is_raised_not_a_rollback(monkeypatch, which, code, status):
    # s3fs gives EIO to every HTTP error code it does not know (a proxy's 502/504, a 429, MinIO's
    # SlowDownRead after its retries); restore took that EIO for a failing medium, skipped the
    # newest checkpoint and resumed from the older one: the good step 3 was rolled back (and
    # replaced by this run's next save) on a gateway's hiccup. It is now the restore's error.
    url = _run_of_three()
    orig = MemoryFileSystem.cat_file
    failing = [True]

    def cat_file(self, path, *args, **kwargs):
        if failing[0] and "step-000000003" in path and which in path.rsplit("/", 1)[-1]:
            raise _s3_error(code, status, "GetObject")
        return orig(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    dest = _model(0.0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match=r"an older checkpoint is not tried") as info:
            mgr.restore({"model": dest})
        assert not isinstance(info.value, tg.CorruptCheckpointError)
    failing[0] = False  # the store answers again: the next restart resumes from step 3
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert mgr.restore({"model": dest}) == 3
    assert torch.all(dest.weight == 3.0)


def test_ls_does_not_call_a_checkpoint_corrupt_for_an_object_store_error(monkeypatch):
    # The same EIO made `trainguard ls --verify` list step 3 corrupt: the operator told to
    # delete a good checkpoint. It is the command's error (one line, exit 2).
    url = _run_of_three()
    orig = MemoryFileSystem.cat_file

    def cat_file(self, path, *args, **kwargs):
        if "step-000000003/data-" in path:
            raise _s3_error("504", 504, "GetObject")
        return orig(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    r = CliRunner().invoke(main, ["ls", url, "--verify"])
    assert r.exit_code == 2 and "corrupt" not in r.output.lower() and "504" in r.output, r.output


def test_verify_of_one_checkpoint_on_an_object_store_checks_that_checkpoint():
    # `trainguard verify s3://bucket/run/step-N` verified the storage's key ("bucket/run/step-N",
    # or "/run/step-N" on memory://) as a local path: a healthy checkpoint was "DELETED, removed
    # while it was checked", exit 1 (--json: status "deleted"), and a corrupt one was never read.
    url = _run_of_three()
    r = CliRunner().invoke(main, ["verify", f"{url}/step-000000003"])
    assert r.exit_code == 0 and "OK" in r.output and "DELETED" not in r.output, r.output
    storage, key = tg.storage.for_path(f"{url}/step-000000003/data-00000.bin")
    data = bytearray(storage.fs.cat_file(key))
    data[0] ^= 0xFF
    storage.fs.pipe_file(key, bytes(data))
    r = CliRunner().invoke(main, ["verify", "--json", f"{url}/step-000000003"])
    assert r.exit_code == 1 and '"status": "corrupt"' in r.output, r.output


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_an_object_store_http_error_in_the_cli_names_the_object_store(monkeypatch, command):
    # A throttled listing (s3fs: OSError(EBUSY, "Please reduce your request rate.")) printed
    # 'error: Please reduce your request rate.': no store, no path, no cause. It is now the CLI's
    # object-store line, as for an unreachable endpoint.
    url = _run_of_three()

    def find(self, path, *args, **kwargs):
        raise _s3_error("SlowDown", 503, "ListObjectsV2")

    monkeypatch.setattr(MemoryFileSystem, "find", find)
    monkeypatch.setattr(MemoryFileSystem, "exists", lambda self, path, **kw: find(self, path))
    r = CliRunner().invoke(main, [command, url])
    assert r.exit_code == 2 and "error: the object store failed: OSError" in r.output and "passing" in r.output, r.output
