"""CheckpointManager: policies, retention, fallback, debris, lock, preemption, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import trainguard as tg
from trainguard import layout
from trainguard.events import read_events
from trainguard.inspect import list_checkpoints

from conftest import ROOT, TESTS
from crashlib import state_for


def _steps(root):
    return [r.step for r in list_checkpoints(root) if r.status == "valid"]


def test_every_n_steps_and_keep_latest(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(3), keep=tg.KeepLatest(2)) as mgr:
        assert mgr.restore(state_for(0)) is None
        saved = [s for s in range(1, 13) if mgr.save(s, state_for(s)) is not None]
    assert saved == [3, 6, 9, 12]
    assert _steps(tmp_path) == [9, 12]
    kinds = [e["event"] for e in read_events(tmp_path)]
    assert kinds.count("save") == 4 and kinds.count("retention_delete") == 2 and "fresh_start" in kinds


def test_keep_every_and_keep_best_combined(tmp_path):
    keep = tg.KeepLatest(2) | tg.KeepEvery(4) | tg.KeepBest("loss", n=1, mode="min")
    losses = {1: 5.0, 2: 0.5, 3: 4.0, 4: 3.0, 5: 2.0, 6: 1.0, 7: 9.0}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=keep) as mgr:
        for s in range(1, 8):
            mgr.save(s, state_for(s), metrics={"loss": losses[s]})
    assert _steps(tmp_path) == [2, 4, 6, 7]


def test_policy_arguments_are_validated_with_reasons():
    with pytest.raises(ValueError, match="at least 2"):
        tg.KeepLatest(1)
    with pytest.raises(ValueError, match="positive"):
        tg.EveryNSteps(0)
    with pytest.raises(TypeError, match="EveryNSteps"):
        tg.CheckpointManager("x", save=100)


def test_every_seconds_uses_the_loops_clock(tmp_path):
    pol = tg.EverySeconds(10)
    pol.on_step(1, 100.0)
    assert not pol.should_save(1, 105.0)
    assert pol.should_save(2, 110.0)
    pol.on_saved(2, 0.1, 0.2)
    pol.on_step(3, 111.0)
    assert not pol.should_save(3, 115.0) and pol.should_save(4, 121.5)


def test_every_seconds_after_a_rollback_decides_by_its_clock_again():
    pol = tg.EverySeconds(10)
    pol.on_step(1, 100.0)
    pol.on_step(5, 110.0)
    assert pol.should_save(5, 110.0)  # its save fails: no on_saved
    pol.on_step(3, 111.0)  # mgr.restore(state, step=2): the loop goes on from 3
    pol.on_step(4, 112.0)
    pol.on_step(5, 113.0)
    assert not pol.should_save(5, 113.0)  # 3 s after the last yes: the old timeline's decision is gone
    pol.on_step(6, 120.5)
    assert pol.should_save(6, 120.5)


def test_restore_falls_back_when_newest_is_corrupt_and_logs_why(tmp_path, caplog):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    data = tmp_path / layout.step_dir(3) / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    man = tmp_path / layout.step_dir(2) / "manifest.json"
    text = man.read_bytes().replace(b'"step":2', b'"step":7')
    man.write_bytes(text)
    state = state_for(0)
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state) == 1
    assert state["progress"]["step"] == 1 and torch.equal(state["data"]["big"], state_for(1)["data"]["big"])
    skips = [e for e in read_events(tmp_path) if e["event"] == "restore_skip"]
    assert [e["step"] for e in skips] == [3, 2]
    assert "checksum mismatch" in skips[0]["reason"] and "data-00000.bin" in skips[0]["reason"]
    assert "manifest" in skips[1]["reason"]


def test_debris_is_cleaned_and_good_checkpoints_kept(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5)) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    (tmp_path / "step-000000003.tmp-abc123").mkdir()
    (tmp_path / "step-000000003.tmp-abc123" / "data-00000.bin").write_bytes(b"x" * 100)
    (tmp_path / layout.step_dir(4)).mkdir()  # no manifest
    trunc = tmp_path / layout.step_dir(5)
    trunc.mkdir()
    full = (tmp_path / layout.step_dir(2) / "manifest.json").read_bytes()
    (trunc / "manifest.json").write_bytes(full[: len(full) // 2])
    future = tmp_path / layout.step_dir(6)
    future.mkdir()
    body = json.loads(json.loads(full)["manifest"] and full[full.index(b'"manifest":') + 11 : -2])
    body["format_version"] = 99
    from trainguard.manifest import checksum

    b = json.dumps(body, separators=(",", ":")).encode()
    (future / "manifest.json").write_bytes(b'{"checksum":"' + checksum(b).encode() + b'","manifest":' + b + b"}\n")
    with pytest.raises(tg.FormatVersionError, match="format_version 99.*upgrade"):
        tg.load(future, state_for(0))
    with pytest.raises(tg.CorruptCheckpointError, match="truncated"):
        tg.load(trunc, state_for(0))
    with pytest.raises(tg.NotACheckpointError, match="not a committed checkpoint"):
        tg.load(tmp_path / layout.step_dir(4), state_for(0))
    state = state_for(0)
    with tg.CheckpointManager(tmp_path) as mgr:
        names = sorted(os.listdir(tmp_path))
        assert "step-000000003.tmp-abc123" not in names and layout.step_dir(4) not in names
        assert mgr.restore(state) == 2
    assert state["progress"]["step"] == 2


def test_existing_step_is_refused_and_overwrite_replaces(tmp_path):
    tg.save(tmp_path / "c", state_for(1))
    with pytest.raises(tg.StepExistsError, match="overwrite=True"):
        tg.save(tmp_path / "c", state_for(2))
    tg.save(tmp_path / "c", state_for(2), overwrite=True)
    st = state_for(0)
    tg.load(tmp_path / "c", st)
    assert st["progress"]["step"] == 2 and sorted(os.listdir(tmp_path)) == ["c"]


def test_strict_load_lists_missing_unexpected_and_mismatched_together(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    tg.save(tmp_path / "c", {"model": m, "extra": {"a": 1}})
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2), torch.nn.Linear(2, 2))
    with pytest.raises(tg.StateMismatchError) as ei:
        tg.load(tmp_path / "c", {"model": other, "more": tg.StateDict()})
    msg = str(ei.value)
    assert "model/2.weight" in ei.value.missing and "more" in ei.value.missing
    assert "extra" in ei.value.unexpected
    assert any("model/0.weight" in x for x in ei.value.mismatched) and "strict=False" in msg
    before = other[2].weight.clone()
    tg.load(tmp_path / "c", {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))}, only=["model"])
    assert torch.equal(other[2].weight, before)


def test_only_loads_a_subset(tmp_path):
    tg.save(tmp_path / "c", state_for(3))
    st = state_for(0)
    tg.load(tmp_path / "c", st, only=["model"])
    assert torch.equal(st["model"].weight, state_for(3)["model"].weight)
    assert st["progress"]["step"] == 0 and not torch.equal(st["data"]["big"], state_for(3)["data"]["big"])


def test_bad_paths_and_manifests_give_clear_errors(tmp_path):
    with pytest.raises(tg.NotACheckpointError, match="no such checkpoint"):
        tg.load(tmp_path / "nope", state_for(0))
    tg.save(tmp_path / "c", state_for(1))
    man = tmp_path / "c" / "manifest.json"
    good = man.read_bytes()
    man.write_bytes(good.replace(b'"step":1', b'"step":2'))
    with pytest.raises(tg.CorruptCheckpointError, match="checksum mismatch: the manifest"):
        tg.load(tmp_path / "c", state_for(0))
    man.write_bytes(good)
    data = tmp_path / "c" / "data-00000.bin"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(tg.CorruptCheckpointError, match="bytes on disk, the manifest says"):
        tg.load(tmp_path / "c", state_for(0))


def test_second_job_on_same_run_dir_is_refused_and_stale_lock_taken_over(tmp_path):
    code = (
        "import sys, trainguard as tg\n"
        "m = tg.CheckpointManager(sys.argv[1]).open()\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT / 'src'}")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(tg.LockedError, match=f"pid {p.pid}.*another directory"):
            tg.CheckpointManager(tmp_path).open()
    finally:
        p.kill()
        p.wait(timeout=30)
    with pytest.warns(UserWarning, match=f"stale lock.*pid {p.pid}"):
        mgr = tg.CheckpointManager(tmp_path).open()
    mgr.close()


def test_sigterm_saves_at_next_step_and_sets_should_stop(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1000)) as mgr:
        assert mgr.save(5, state_for(5)) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert not mgr.should_stop
        h = mgr.save(6, state_for(6))
        assert h is not None and h.done() and mgr.should_stop
    assert _steps(tmp_path) == [6]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_on_error_warn_keeps_training_and_retries(tmp_path, monkeypatch):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), on_error="warn") as mgr:
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_fsync")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        with pytest.warns(UserWarning, match="save of step 1 failed"):
            assert mgr.save(1, state_for(1)) is None
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        assert mgr.save(2, state_for(2)) is not None
    assert _steps(tmp_path) == [2]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1)) as mgr:
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "write_begin")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        with pytest.raises(tg.CheckpointError, match="injected failure at write_begin"):
            mgr.save(3, state_for(3))
    assert _steps(tmp_path) == [2]


def test_retention_failure_is_reported_not_raised(tmp_path, monkeypatch):
    class Broken(tg.KeepLatest):
        def select(self, checkpoints):
            raise OSError("permission denied while listing")

    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=Broken(2)) as mgr:
        with pytest.warns(UserWarning, match="retention after step 1 failed"):
            assert mgr.save(1, state_for(1)) is not None
        with pytest.warns(UserWarning, match="retention after step 2 failed"):
            mgr.save(2, state_for(2))
    assert _steps(tmp_path) == [1, 2]
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "retention_failed"] == [1, 2]


def test_a_failed_open_releases_the_run_dir_lock(tmp_path, monkeypatch):
    """Rank 0 took the lock, then the debris cleanup failed (a permission error, say): the open
    raises, and the same process can open the directory once the cause is gone. The lock stayed
    held before: every later open in the process said another manager was using the directory."""
    import trainguard.manager as manager_mod

    def broken(storage, root):
        raise PermissionError(13, "Permission denied", root)

    monkeypatch.setattr(manager_mod, "clean_debris", broken)
    with pytest.raises(tg.CheckpointError, match="Permission denied"):
        tg.CheckpointManager(tmp_path, handle_signals=False).open()
    monkeypatch.undo()
    with tg.CheckpointManager(tmp_path, handle_signals=False) as m:
        m.save(1, {"w": torch.ones(2)}, force=True)
    assert (tmp_path / "step-000000001" / "manifest.json").exists()


def test_an_event_log_that_cannot_be_written_does_not_fail_saves_or_restores(tmp_path, caplog):
    # The log is a record: a full disk or a removed/replaced events.jsonl used to raise OSError
    # out of a save that had committed (and out of open/restore).
    model = torch.nn.Linear(4, 4)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1)) as mgr:
        (tmp_path / "events.jsonl").unlink()
        (tmp_path / "events.jsonl").mkdir()  # every append now fails (IsADirectoryError)
        with caplog.at_level("WARNING", logger="trainguard"):
            assert mgr.save(1, {"model": model}) is not None
            assert mgr.save(2, {"model": model}) is not None
            fresh = torch.nn.Linear(4, 4)
            assert mgr.restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight, model.weight)
    assert sum("cannot write the event log" in r.getMessage() for r in caplog.records) == 1
