"""Claims added to README.md and docs/*.md in one session, checked by running what they say
(helper review "docs13")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.errors import NotACheckpointError


def _cut_overwrite_between_renames(monkeypatch, path: Path) -> None:
    """``tg.save(path, overwrite=True)`` whose second rename (the new checkpoint into place) fails:
    the previous checkpoint is left at ``<name>.old-<id>`` (docs/checkpoints.md, Where a save may go)."""
    storage = type(tg.storage.for_path(str(path))[0])
    orig = storage.rename_dir
    calls: list[tuple[str, str]] = []

    def second_fails(self, src: str, dst: str) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError(5, "injected EIO")
        orig(self, src, dst)

    monkeypatch.setattr(storage, "rename_dir", second_fails)
    with pytest.raises(tg.CheckpointError):
        tg.save(path, {"x": torch.zeros(3)}, overwrite=True)
    monkeypatch.setattr(storage, "rename_dir", orig)
    assert ".old-" in calls[0][1]


@pytest.mark.parametrize("name", ["step-000000005", "final"])
def test_load_names_the_previous_checkpoint_an_overwrite_cut_short_left_aside(tmp_path, monkeypatch, name):
    # "a crash between the two renames leaves the old one there, ... and tg.load(path) names it
    # meanwhile": for any path tg.save writes, not only a manager's step-N names.
    path = tmp_path / name
    tg.save(path, {"x": torch.ones(3)})
    _cut_overwrite_between_renames(monkeypatch, path)
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith(f"{name}.old-")]
    with pytest.raises(NotACheckpointError, match=f"previous checkpoint is {old}"):
        tg.load(path, {"x": torch.empty(3)})
    dest = {"x": torch.empty(3)}
    tg.load(old, dest)  # what the message says to do works
    assert torch.equal(dest["x"], torch.ones(3))
