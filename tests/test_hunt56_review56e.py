"""Session 56's hostile review of retention and automatic restore over damaged checkpoints (helper review56e).

- Retention counted a kept checkpoint whose data file was cut short, grown or removed (a torn write the file system
  did not report, a copy of the directory cut short, a hand edit) as one of ``KeepLatest(n)``'s n: with
  ``KeepLatest(2)``, step 4's data file truncated, the save of step 5 deleted step 3, the only good checkpoint before
  5. Retention now compares the files' sizes of the checkpoints that stand in for those it deletes with their
  manifest's (a stat each, no byte read; ``keptseen.kept_damaged``): a damaged one takes no slot, and the older good
  one stays until enough newer sound ones exist.
- The warning of the first save after such a restore, setting the skipped step aside, called it only "an abandoned
  timeline" (a rollback's words); it now says restore found it unusable.
- Checked and held up: ``restore`` skipping a corrupt newest checkpoint (a flipped byte, 1 and 2 ranks) names the
  step, the file and the tensor in its warning and its ``restore_skip`` event, and the run's saves after it keep
  the step it restored from until ``KeepLatest(2)`` holds two newer ones.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from tests.dist_helper import run_ranks

import trainguard as tg


def _step(run: Path, step: int) -> Path:
    return run / f"step-{step:09d}"


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run.iterdir() if p.name.startswith("step-") and (p / "manifest.json").exists())


class Local:
    """A rank-local entry: each rank's tensor in its own data file."""

    trainguard_rank_local = True

    def __init__(self, rank: int) -> None:
        self.t = torch.arange(50_000.0) + rank

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])


def _state(rank: int = 0) -> dict:
    return {"w": torch.arange(50_000.0), "local": Local(rank), "progress": tg.StateDict(step=0)}


def _damage(ckpt: Path, how: str, fname: str = "data-00000.bin") -> None:
    data = ckpt / fname
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "missing":
        data.unlink()
    elif how == "grown":
        with open(data, "ab") as f:
            f.write(b"\0" * 8)
    elif how == "flipped":
        body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
        off = next(c[3] for t in body["tensors"].values() for c in t["chunks"] if c[2] == fname)
        with open(data, "r+b") as f:
            f.seek(off + 10)
            b = f.read(1)
            f.seek(off + 10)
            f.write(bytes([b[0] ^ 0xFF]))


def _events(run: Path, kind: str) -> list[dict]:
    with open(run / "events.jsonl") as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


@pytest.mark.parametrize("how", ["truncated", "missing", "grown", "truncated-threads"])
def test_a_kept_checkpoint_with_a_damaged_data_file_takes_no_keeplatest_slot(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how.endswith("-threads"):  # the files stat'ed a few at once, as for a checkpoint of many ranks
        import trainguard.keptseen

        monkeypatch.setattr(trainguard.keptseen, "MANY_FILES", 1, raising=False)
        how = how.split("-")[0]
    run, state = tmp_path / "run", _state()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for s in (3, 4):
            state["w"].add_(1)
            mgr.save(s, state)
        _damage(_step(run, 4), how)
        state["w"].add_(1)
        mgr.save(5, state)
        # Before: [4, 5], step 3 deleted: the only checkpoint before 5 that loads.
        assert _steps(run) == [3, 4, 5]
        assert tg.verify(_step(run, 3)).ok
        assert [e["step"] for e in _events(run, "retention_damaged")] == [4]
        state["w"].add_(1)
        mgr.save(6, state)  # two sound ones newer than 3: 3 goes, and so does the damaged 4 behind them
        assert _steps(run) == [5, 6]


def test_the_newest_checkpoint_damaged_keeps_two_older_ones(tmp_path: Path) -> None:
    run, state = tmp_path / "run", _state()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for s in (1, 2):
            mgr.save(s, state)
        _damage(_step(run, 2), "truncated")
        mgr.save(3, state)  # 2 damaged: 1 and 3 are the two kept sound ones
        assert _steps(run) == [1, 2, 3]
        _damage(_step(run, 3), "missing")
        mgr.save(4, state)  # 3 damaged too: 1 and 4
        assert _steps(run) == [1, 2, 3, 4]
        mgr.save(5, state)
        assert _steps(run) == [4, 5]


def test_keepbest_keeps_the_next_best_when_the_best_is_damaged(tmp_path: Path) -> None:
    run, state = tmp_path / "run", _state()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", 1), handle_signals=False) as mgr:
        for s, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
            mgr.save(s, state, metrics={"loss": loss})
        _damage(_step(run, 2), "truncated")
        mgr.save(4, state, metrics={"loss": 5.0})
        # Before: [2, 4], the best one kept though it does not load, the next best (3) deleted.
        assert [s for s in _steps(run) if s != 4 and tg.verify(_step(run, s)).ok] == [3]


def test_a_damaged_checkpoint_of_an_earlier_run_found_by_its_manifests_sizes(tmp_path: Path) -> None:
    """The steps this manager did not write: their sizes come from their manifest, read once."""
    run, state = tmp_path / "run", _state()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), handle_signals=False) as mgr:
        assert mgr.restore(state) == 3
        _damage(_step(run, 2), "truncated")
        mgr.save(4, state)  # keeps 1, 3, 4 (2 damaged)
        assert _steps(run) == [1, 2, 3, 4]


def _restore_past_a_corrupt_newest(rank: int, world: int, run: str) -> list:
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("trainguard").addHandler(Grab())
    state, root = _state(rank), Path(run)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        got = mgr.restore(state)
        assert torch.equal(state["local"].t, torch.arange(50_000.0) + rank + 1)  # step 3's
        listed = []
        for s, how in ((5, "truncated"), (6, None), (7, None)):
            state["local"].t.add_(1)
            mgr.save(s, state)
            if rank == 0:
                listed.append(_steps(root))
                if how:
                    _damage(_step(root, s), how, "data-00001.bin")
    return [got, listed, records]


def _save_two_steps(rank: int, world: int, run: str) -> None:
    state = _state(rank)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for s in (3, 4):
            state["local"].t.add_(1)
            mgr.save(s, state)


def test_two_ranks_restore_past_a_corrupt_newest_says_which_and_why_and_keeps_what_it_restored(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_ranks(_save_two_steps, 2, str(run), timeout=120)
    _damage(_step(run, 4), "flipped", "data-00001.bin")  # rank 1's bytes: bit rot, no size change
    results = run_ranks(_restore_past_a_corrupt_newest, 2, str(run), timeout=120)
    got, listed, records = results[0].value
    assert got == 3 and results[1].value[0] == 3
    skip = [r for r in records if "step 4 is not usable" in r]
    assert skip and "data-00001.bin" in skip[0] and "local" in skip[0], records
    assert [(e["step"], "data-00001.bin" in e["reason"]) for e in _events(run, "restore_skip") if e["rank"] == 0] == [(4, True)]
    # The first save sets step 4 aside (deleted at its commit): the warning says it is the one restore found unusable,
    # not only "an abandoned timeline" (a rollback's words).
    assert any("setting aside" in r and "restore found 4 unusable" in r for r in records), records
    # After 5: 3 (restored) and 5; step 5 then cut short: 6 keeps 3 (before: [5, 6], nothing before 6 loads);
    # 7: two sound ones newer than 3.
    assert listed == [[3, 5], [3, 5, 6], [6, 7]]
    assert any("step 5" in r and "damaged" in r and "data-00001.bin" in r for r in records), records
