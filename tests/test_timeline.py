"""A run that goes back in steps: it resumed from an older checkpoint than the newest in its run
directory (newer ones were corrupt, or the operator rolled back with ``restore(state, step=N)``). Its saves must
go on without manual cleanup, replacing steps an earlier run left, and the next restart must not
jump back to that earlier run's newer checkpoints (an abandoned timeline)."""

from __future__ import annotations

import logging
import os
import uuid

import pytest
import torch

import trainguard as tg
from trainguard.events import read_events


def _state(v: float) -> dict:
    return {"w": torch.full((8,), float(v)), "p": tg.StateDict(step=0)}


def _steps(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and "." not in n)


def _dead_run(root, last: int = 43) -> None:
    """The run that crashed at step ``last``: committed 10, 20, 30, 40 (w = step)."""
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in range(1, last + 1):
            m.save(s, _state(s))


def _flip(root, step: int) -> None:
    f = os.path.join(root, f"step-{step:09d}", "data-00000.bin")
    b = bytearray(open(f, "rb").read())
    b[0] ^= 1
    open(f, "wb").write(b)


def test_a_rolled_back_run_replaces_the_dead_runs_steps_and_drops_its_newer_ones(tmp_path):
    _dead_run(tmp_path)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(10), keep=tg.KeepLatest(3), handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x, step=15) == 10  # the operator rolls back past a loss spike
        for s in range(11, 26):
            m.save(s, _state(1000 + s))  # step 20 exists from the dead run: replaced, not refused
        assert _steps(tmp_path) == [10, 20]  # 30, 40: newer steps of the abandoned run, removed
    dropped = [e["step"] for e in read_events(tmp_path) if e["event"] == "retention_delete"]
    assert sorted(dropped) == [30, 40]
    with tg.CheckpointManager(tmp_path, handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x) == 20
        assert x["w"][0].item() == 1020.0  # this run's step 20, not the dead run's


def test_a_run_resumed_behind_corrupt_checkpoints_drops_them_at_its_first_save(tmp_path, caplog):
    _dead_run(tmp_path)
    _flip(tmp_path, 30)
    _flip(tmp_path, 40)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), keep=tg.KeepLatest(2), handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x) == 20
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            for s in range(21, 28):
                m.save(s, _state(1000 + s))
        assert _steps(tmp_path) == [20, 25]  # not 30 and 40 kept "newer" until the run passes them
    assert any("30, 40" in r.getMessage() and "abandoned" in r.getMessage() for r in caplog.records)
    n = len(list(read_events(tmp_path)))
    with tg.CheckpointManager(tmp_path, handle_signals=False) as m:  # the next restart
        x = _state(0)
        assert m.restore(x) == 25 and x["w"][0].item() == 1025.0
    assert not [e for e in list(read_events(tmp_path))[n:] if e["event"] == "restore_skip"]


def test_newer_checkpoints_of_a_dead_run_take_no_keeplatest_slot(tmp_path):
    _dead_run(tmp_path)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(2), keep=tg.KeepLatest(2), handle_signals=False) as m:
        m.restore(_state(0), step=10)
        for s in range(11, 17):
            m.save(s, _state(1000 + s))
        # 12, 14, 16 saved by this run: KeepLatest(2) keeps this run's two newest
        assert _steps(tmp_path) == [14, 16]


def test_a_manager_that_did_not_restore_keeps_an_earlier_runs_checkpoints(tmp_path, caplog):
    """No restore(): the manager knows nothing of the directory's timeline (a new experiment pointed
    at an old directory by mistake, a rollback done with tg.load). It removes none of the earlier
    run's checkpoints, warns about the newer ones, and refuses a step that exists, saying how to
    roll back on purpose."""
    _dead_run(tmp_path)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), keep=tg.KeepLatest(2), handle_signals=False) as m:
        tg.load(tmp_path / "step-000000010", _state(0))
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            m.save(5, _state(1005))
        assert _steps(tmp_path) == [5, 10, 20, 30, 40]
        with pytest.raises(tg.StepExistsError, match=r"restore\(state, step=") as e:
            m.save(10, _state(1010))
        assert "overwrite=True" not in str(e.value)
    assert any("20, 30, 40" in r.getMessage() and "kept" in r.getMessage() for r in caplog.records)
    assert _steps(tmp_path) == [5, 10, 20, 30, 40]
    x = _state(0)
    tg.load(tmp_path / "step-000000010", x)
    assert x["w"][0].item() == 10.0  # the earlier run's step 10, untouched


def test_a_run_that_only_moves_forward_deletes_nothing_newer(tmp_path):
    _dead_run(tmp_path)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x) == 40
        for s in range(40, 56):
            m.save(s, _state(s))
    assert _steps(tmp_path) == [10, 20, 30, 40, 50]


def test_a_rolled_back_run_on_an_object_store(tmp_path):
    pytest.importorskip("fsspec")
    url = f"memory://tg-{uuid.uuid4().hex[:10]}"
    with tg.CheckpointManager(url, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in range(1, 44):
            m.save(s, _state(s))
    with tg.CheckpointManager(url, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        m.restore(_state(0), step=10)
        for s in range(11, 26):
            m.save(s, _state(1000 + s))
    with tg.CheckpointManager(url, handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x) == 20 and x["w"][0].item() == 1020.0
        assert [s for s in (10, 20, 30, 40) if m.storage.exists(m.storage.join(m._root, f"step-{s:09d}"))] == [10, 20]


def test_a_rolled_back_run_with_the_ram_tier_replaces_the_durable_copy(tmp_path):
    _dead_run(tmp_path / "run")
    base = str(tmp_path / "shm")
    os.mkdir(base)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(10), keep=tg.KeepAll(), ram_tier=base,
                              handle_signals=False) as m:
        m.restore(_state(0), step=10)
        for s in range(11, 26):
            m.save(s, _state(1000 + s))
    x = _state(0)
    tg.load(tmp_path / "run" / "step-000000020", x)  # the durable copy is this run's, not the dead run's
    assert x["w"][0].item() == 1020.0 and _steps(tmp_path / "run") == [10, 20]


class _SeenPolicy(tg.RetentionPolicy):
    """A custom policy (keep all) that records what it was shown, as a time-based one would read it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def select(self, checkpoints):
        self.seen = [(c.step, c.created) for c in checkpoints]
        return {c.step for c in checkpoints}


def test_a_custom_retention_policy_sees_when_each_checkpoint_was_created(tmp_path):
    from trainguard.commit import read_manifest
    from trainguard.storage import for_path

    _dead_run(tmp_path, last=20)  # 10, 20 from an earlier process: read from their manifests
    policy = _SeenPolicy()
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(10), keep=policy, handle_signals=False) as m:
        assert m.restore(_state(0)) == 20
        for s in range(21, 41):
            m.save(s, _state(s))
    want = [(s, read_manifest(*for_path(str(tmp_path / f"step-{s:09d}"))).created) for s in (10, 20, 30, 40)]
    assert policy.seen == want and all(c > 1e9 for _, c in want)


def test_retention_by_step_alone_reads_no_manifest_after_a_restart(tmp_path, monkeypatch):
    """The first save after a restart ran retention over every kept checkpoint, reading each one's
    manifest for metrics a step-only policy never looks at (300 on S3: 2.6 s against 0.18 s with 10)."""
    from trainguard import retention

    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in range(1, 31):
            m.save(s, _state(s))
    reads = []
    real = retention.read_facts
    monkeypatch.setattr(retention, "read_facts", lambda *a: reads.append(a[1]) or real(*a))
    keep = tg.KeepLatest(3) | tg.KeepEvery(10)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as m:
        assert m.restore(_state(0)) == 30
        m.save(31, _state(31))
    assert reads == [] and _steps(tmp_path) == [10, 20, 29, 30, 31]
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", 1) | tg.KeepLatest(2),
                              handle_signals=False) as m:
        m.save(32, _state(32), metrics={"loss": 0.5})
    assert len(reads) == 5  # a policy that ranks by metrics reads them: 10, 20, 29, 30, 31


def test_a_loop_that_restarts_from_zero_after_restore_is_refused_not_destructive(tmp_path):
    """restore() returned 40 and the loop started again at step 1 (a bug): saving step 10 would
    replace this run's step 10 and drop 20, 30, 40. Refused, naming what to do; nothing deleted."""
    _dead_run(tmp_path)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        assert m.restore(_state(0)) == 40
        for s in range(1, 10):
            m.save(s, _state(s))
        with pytest.raises(tg.CheckpointError, match=r"restore\(\) resumed this run from step 40") as e:
            m.save(10, _state(10))
        assert "restore(state, step=" in str(e.value)
    assert _steps(tmp_path) == [10, 20, 30, 40]


def test_restore_at_a_step_rolls_back_and_the_next_restart_stays_on_the_new_timeline(tmp_path):
    _dead_run(tmp_path)
    _flip(tmp_path, 20)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), keep=tg.KeepAll(), handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x, step=30) == 30 and x["w"][0].item() == 30.0  # at or before 30: 30
        assert _steps(tmp_path) == [10, 20, 30, 40]  # nothing is deleted before this run saves
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(5), keep=tg.KeepAll(), handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x, step=25) == 10  # 20 is corrupt: the newest usable one before it
        for s in range(11, 16):
            m.save(s, _state(1000 + s))
        assert _steps(tmp_path) == [10, 15]  # 20 (corrupt), 30, 40: the abandoned timeline
    with tg.CheckpointManager(tmp_path, handle_signals=False) as m:
        x = _state(0)
        assert m.restore(x) == 15 and x["w"][0].item() == 1015.0
        with pytest.raises(tg.CheckpointError, match="no checkpoint at or before step 5"):
            m.restore(_state(0), step=5)


def rollback_group(rank: int, world: int, root: str) -> dict:
    """Every rank: the dead run (10..40), then a rollback to 20 and saves to 35; then a loop that
    starts again at 0 after restore(). Returns what each rank saw."""
    _dead_run(root)
    out: dict = {}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        x = _state(0)
        out["restored"] = m.restore(x, step=25)
        for s in range(21, 36):
            m.save(s, {"w": torch.full((8,), 1000.0 + s), "p": tg.StateDict(step=s)})
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as m:
        x = _state(0)
        out["after"] = (m.restore(x), x["w"][0].item())
        try:
            m.save(10, _state(10))
            out["refused"] = False
        except tg.CheckpointError as e:
            out["refused"] = "restore() resumed this run from step 30" in str(e)
    out["steps"] = _steps(root)
    return out


def test_a_rollback_on_two_ranks(tmp_path):
    from dist_helper import run_ranks

    res = run_ranks(rollback_group, 2, str(tmp_path), timeout=120)
    assert all(r.ok for r in res), [r.error for r in res]
    for r in res:
        assert r.value == {"restored": 20, "after": (30, 1030.0), "refused": True, "steps": [10, 20, 30]}
