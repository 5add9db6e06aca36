"""A store whose listings lag behind its writes (some S3-compatible servers, a caching proxy): the object-store
check before the manifest (``samesave.check_objects``, one listing of the step directory) looks for a name the
listing lacks with a HEAD before it fails the save; a file really gone still fails it."""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg
from trainguard.errors import CheckpointError
from trainguard.storage.fsspec import FsspecStorage


def _lagging(monkeypatch: pytest.MonkeyPatch) -> None:
    real = FsspecStorage.objects
    # the step's directory lists without its data files (not shown yet); everything else as it is
    monkeypatch.setattr(FsspecStorage, "objects", lambda self, p: {n: v for n, v in real(self, p).items()
                                                                   if "step-" not in p or not n.endswith(".bin")})


def test_a_listing_that_lags_does_not_fail_the_save(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://tg-lag-{uuid.uuid4().hex}/step-000000001"
    _lagging(monkeypatch)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    tg.save(url, state)
    monkeypatch.undo()
    out = {"w": torch.zeros(1000)}
    tg.load(url, out)
    assert torch.equal(out["w"], state["w"])


def test_a_file_gone_before_the_manifest_still_fails_the_save(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://tg-lag-{uuid.uuid4().hex}/step-000000001"
    _lagging(monkeypatch)
    real_exists = FsspecStorage.exists
    monkeypatch.setattr(FsspecStorage, "exists", lambda self, p: False if p.endswith(".bin") else real_exists(self, p))
    with pytest.raises(CheckpointError, match="before its manifest was written"):
        tg.save(url, {"w": torch.ones(10)})
