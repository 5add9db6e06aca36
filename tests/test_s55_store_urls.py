"""A save refused because its directory is taken names it as the user wrote it: a URL on an object
store (``memory://bkt/run/ck``), not the store's own key (``/bkt/run/ck``, which reads as a local path)."""

from __future__ import annotations

import fsspec
import pytest
import torch

import trainguard as tg


@pytest.fixture
def url():
    path = "memory://tg-s55-urls/run/ck"
    yield path
    fs = fsspec.filesystem("memory")
    if fs.exists("/tg-s55-urls"):
        fs.rm("/tg-s55-urls", recursive=True)


def test_saving_over_a_committed_checkpoint_names_its_url(url):
    tg.save(url, {"w": torch.ones(3)})
    with pytest.raises(tg.StepExistsError, match=r"^memory://") as e:
        tg.save(url, {"w": torch.zeros(3)})
    assert "already holds a committed checkpoint" in str(e.value)
    with pytest.raises(tg.CheckpointError, match=r"^memory://.*cannot replace a directory atomically"):
        tg.save(url, {"w": torch.zeros(3)}, overwrite=True)
    back = {"w": torch.zeros(3)}
    tg.load(url, back)
    assert torch.equal(back["w"], torch.ones(3))  # the refused saves left the checkpoint alone


def test_saving_into_a_directory_of_other_files_names_its_url(url):
    fs = fsspec.filesystem("memory")
    fs.pipe(url.removeprefix("memory:/") + "/notes.txt", b"mine")
    with pytest.raises(tg.CheckpointError, match=r"^memory://.*notes\.txt"):
        tg.save(url, {"w": torch.ones(3)})
    assert fs.cat(url.removeprefix("memory:/") + "/notes.txt") == b"mine"
