"""Claims added to README.md and docs/*.md in one session, checked by running what they say
(helper review "docs13")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.errors import NotACheckpointError


def _cut_overwrite_between_renames(monkeypatch, path: Path) -> None:
    """``tg.save(path, overwrite=True)`` cut short between its two renames, as by a crash: the
    second rename (the new checkpoint into place) fails, and so does every later one (the save's
    move back of the previous checkpoint), which is left at ``<name>.old-<id>`` (docs/checkpoints.md,
    Where a save may go)."""
    storage = type(tg.storage.for_path(str(path))[0])
    orig = storage.rename_dir
    calls: list[tuple[str, str]] = []

    def second_fails(self, src: str, dst: str) -> None:
        calls.append((src, dst))
        if len(calls) >= 2:
            raise OSError(5, "injected EIO")
        orig(self, src, dst)

    monkeypatch.setattr(storage, "rename_dir", second_fails)
    with pytest.raises(tg.CheckpointError), pytest.warns(UserWarning, match="could not move the previous checkpoint"):
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


@pytest.mark.parametrize("step, restored", [(None, 5), (5, 5), (4, 4)])
def test_a_restore_after_a_failed_rollback_save_sees_the_steps_it_set_aside(tmp_path, monkeypatch, step, restored):
    # docs/checkpoints.md: a crash before the rollback's first save commits resumes "from the earlier
    # timeline's newest, as if this run never saved". A restore in the same process after that save
    # failed (on_error="warn") must see the same: before, the steps set aside (4 and 5) were hidden,
    # restore() returned the earlier timeline's step 3 and restore(step=5) step 3 too.
    from test_rollback_crash import _first_run, _rollback_and_fail, _steps

    root = tmp_path / "run"
    _first_run(root)
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False, on_error="warn") as mgr:
        _rollback_and_fail(mgr, state, monkeypatch)
        assert mgr.restore(state, step=step) == restored
        assert float(state["w"][0]) == restored * 10.0
        assert _steps(root) == [f"step-00000000{i}" for i in range(1, 6)]
        state["w"].fill_(restored * 10.0 + 1)
        mgr.save(restored + 1, state)
    want = [f"step-00000000{i}" for i in range(1, restored + 2)]
    assert _steps(root) == want
    fresh = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore(fresh) == restored + 1
    assert float(fresh["w"][0]) == restored * 10.0 + 1
