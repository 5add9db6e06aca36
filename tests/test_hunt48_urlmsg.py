"""Errors about a checkpoint on an object store name it by its URL (``s3://bucket/run/step-N``), as
the user gave it: they named the store's key (``bucket/run/step-N``), which reads as a local relative
path (a user looked for it on local disk). On fsspec's ``memory://`` (one process) and on the
session's SeaweedFS server (tests/test_storage_s3.py)."""

from __future__ import annotations

import uuid

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main as cli
from trainguard.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from trainguard.storage import for_path

pytest.importorskip("fsspec")


def _state() -> dict:
    return {"w": torch.arange(8.0)}


def _messages(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed tg.save (a fault at commit, one at a write), a failed manager save, a load of a missing
    checkpoint, of a run directory and of one whose data file is gone, ``trainguard inspect`` of a missing
    one: each names ``url``'s scheme."""
    scheme = url.split("://")[0] + "://"
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    for point in ("before_manifest", "write_begin"):
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", point)
        with pytest.raises(CheckpointError, match=f"save of {scheme}.*step-000000001 failed") as e:
            tg.save(f"{url}/step-000000001", _state())
        assert str(e.value).startswith(f"save of {scheme}"), e.value
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        with pytest.raises(CheckpointError) as e:
            mgr.save(2, _state())
        assert f"save of {scheme}" in str(e.value) and "step-000000002" in str(e.value), e.value
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        mgr.save(3, _state())
    with pytest.raises(NotACheckpointError) as e:
        tg.load(f"{url}/step-000000009", _state())
    assert str(e.value).startswith(scheme) and "no such checkpoint directory" in str(e.value), e.value
    with pytest.raises(NotACheckpointError) as e:
        tg.load(url, _state())  # the run directory, not one of its checkpoints
    assert str(e.value).startswith(scheme) and "is a run directory" in str(e.value), e.value
    storage, root = for_path(url)
    storage.fs.rm_file(storage.join(root, "step-000000003", "data-00000.bin"))  # the manifest stays: a corrupt checkpoint
    with pytest.raises(CorruptCheckpointError) as e:
        tg.load(f"{url}/step-000000003", _state())
    assert str(e.value).startswith(scheme) and "data file is missing" in str(e.value), e.value
    r = CliRunner().invoke(cli, ["inspect", f"{url}/step-000000009"])
    assert r.exit_code != 0 and r.output.startswith(f"error: {scheme}") and "no such checkpoint directory" in r.output, r.output


def test_errors_name_the_url_on_memory(monkeypatch):
    _messages(f"memory://tg-{uuid.uuid4().hex[:10]}/run", monkeypatch)


from test_storage_s3 import weed  # noqa: E402,F401  (the session's server; skips without `weed`)


def test_errors_name_the_url_on_s3(weed, monkeypatch):  # noqa: F811
    _messages(f"s3://tgtest/{uuid.uuid4().hex[:10]}", monkeypatch)
