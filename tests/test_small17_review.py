"""Review small17: a failure on rank 0 before the RAM tier's "ram_room" round, the stall of a sync
save retried to disk after its RAM attempt ran out of room, and a load with ``split_state=True``
on some ranks only."""

from __future__ import annotations

import errno
import json
import os
import time
import types
import warnings

import torch

import trainguard as tg

from dist_helper import run_ranks


def _events(root: str, kind: str) -> list[dict]:
    with open(os.path.join(root, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


# ------------------------------------------------------------------ 1. rank 0 fails before "ram_room"
def _make_room_fails_on_rank_0(rank: int, world: int, root: str, base: str, on_error: str) -> list:
    from trainguard.tiers import RamTier

    real = RamTier.make_room
    calls = []

    def make_room(self) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected make_room failure", self.dir)
        real(self)

    if rank == 0:
        RamTier.make_room = make_room  # this process only
    out: list = []
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as seen, tg.CheckpointManager(
            root, save=tg.EveryNSteps(1), ram_tier=base, on_error=on_error, handle_signals=False, timeout=60) as mgr:
        warnings.simplefilter("always")
        try:
            out.append(mgr.save(1, {"progress": tg.StateDict(step=1)}) is not None)
        except Exception as e:  # the test looks at what each rank got
            out.append(f"{type(e).__name__}: {e}")
        out.append(time.monotonic() - t0 < 30)  # not the round's timeout (60 s): rank 0's error came at once
        out.append(any("injected make_room failure" in str(w.message) for w in seen))
        out.append(mgr.save(2, {"progress": tg.StateDict(step=2)}) is not None)
    return out


def test_make_room_failing_on_rank_0_fails_the_save_on_every_rank_at_once(tmp_path):
    """Before, rank 0 raised the bare OSError out of ``save()`` (on_error="warn" or not) and rank 1
    waited in the "ram_room" broadcast until the manager's timeout. Now rank 0 broadcasts the error
    instead of its answer: every rank fails the save with a CheckpointError naming it, reported
    per ``on_error`` (a warning here), and the next save goes through."""
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    res = run_ranks(_make_room_fails_on_rank_0, 2, root, base, "warn", timeout=150, check=False)
    assert [r.error for r in res] == [None, None], [r.error for r in res]
    assert [r.value for r in res] == [[False, True, True, True]] * 2
    failed = _events(root, "save_failed")
    assert [e["step"] for e in failed] == [1, 1]
    assert all("injected make_room failure" in e["error"] for e in failed)
    assert sorted(s for s in os.listdir(root) if s.startswith("step-")) == ["step-000000002"]


def test_make_room_failing_on_rank_0_raises_a_checkpoint_error_on_every_rank(tmp_path):
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    res = run_ranks(_make_room_fails_on_rank_0, 2, root, base, "raise", timeout=150, check=False)
    assert [r.error for r in res] == [None, None], [r.error for r in res]
    for r in res:
        first, fast = r.value[:2]
        assert first.startswith("CheckpointError: ") and "injected make_room failure" in first and "rank 0" in first, first
        assert fast


def test_make_room_failing_in_one_process_is_reported_per_on_error(tmp_path, monkeypatch):
    from trainguard.tiers import RamTier

    def make_room(self) -> None:
        raise OSError(errno.EIO, "injected make_room failure", self.dir)

    monkeypatch.setattr(RamTier, "make_room", make_room)
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    with warnings.catch_warnings(record=True) as seen, tg.CheckpointManager(
            root, save=tg.EveryNSteps(1), ram_tier=base, on_error="warn", handle_signals=False) as mgr:
        warnings.simplefilter("always")
        assert mgr.save(1, {"progress": tg.StateDict(step=1)}) is None
    assert any("injected make_room failure" in str(w.message) for w in seen)


# ------------------------------------------------------------------ 2. the stall of a retried sync save
def test_a_sync_save_retried_to_disk_reports_the_failed_ram_attempt_in_its_stall(tmp_path, monkeypatch):
    """A sync save whose RAM attempt ran out of room is saved again to the run directory at once
    (``_save_now`` calls itself). Before, the retry started a new clock: the time training spent
    on the failed attempt was missing from the stall and duration the save policy and the ``save``
    event got. A fake clock jumps 1000 s during the failed attempt."""
    from trainguard import api, handle, manager, saveevent
    from trainguard.errors import DiskFullError
    from trainguard.tiers import ram_dir

    offset = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0], time=time.time)
    for mod in (manager, handle, saveevent):  # saveevent: the save event (was policies)
        monkeypatch.setattr(mod, "time", clock)
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    ram = ram_dir(root, base)
    real = api.write_streams

    def write_streams(storage, work, *a, **k):  # a sync save's data files
        if str(work).startswith(ram) and not offset[0]:
            offset[0] = 1000.0  # the failed attempt took 1000 s
            raise DiskFullError(errno.ENOSPC, f"No space left on device: {work}")
        return real(storage, work, *a, **k)

    monkeypatch.setattr(api, "write_streams", write_streams)
    seen = []

    class Policy(tg.EveryNSteps):
        def on_saved(self, step, stall, duration):
            seen.append((step, stall, duration))
            super().on_saved(step, stall, duration)

    with tg.CheckpointManager(root, save=Policy(1), ram_tier=base, handle_signals=False) as mgr:
        assert mgr.save(1, {"model": torch.nn.Linear(4, 4)}) is not None
    assert [e["step"] for e in _events(root, "ram_no_room")] == [1]
    (ev,) = _events(root, "save")
    assert ev["step"] == 1 and ev["stall_s"] >= 1000 and ev["duration_s"] >= 1000, ev
    assert seen and seen[0][0] == 1 and seen[0][1] >= 1000 and seen[0][2] >= 1000, seen


# ------------------------------------------------------------------ 3. split_state on some ranks only
def _split_on_rank_0_only(rank: int, world: int, path: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    tg.save(path, {"model": model}, timeout=20)
    t0 = time.monotonic()
    try:
        tg.load(path, {"model": model}, split_state=rank == 0, timeout=60)  # the error comes at once: < 30 s
    except tg.CheckpointError as e:
        return f"{time.monotonic() - t0 < 30} {type(e).__name__}: {e}"
    return "loaded"


def test_a_load_with_split_state_on_some_ranks_only_says_so_on_every_rank(tmp_path):
    """Before, rank 0 went to the "split-taken" gather of ``split.check_taken`` and rank 1 to the
    "loaded" round: both failed with "ranks called different trainguard operations", which does not
    say what to change. The "load" round now carries each rank's flag: every rank raises one error
    naming split_state."""
    res = run_ranks(_split_on_rank_0_only, 2, str(tmp_path / "ck"), timeout=150, check=False)
    assert [r.error for r in res] == [None, None], [r.error for r in res]
    for r in res:
        assert r.value.startswith("True CheckpointError: "), r.value
        assert "split_state=True" in r.value and "rank(s) [0]" in r.value, r.value
        assert "different trainguard operations" not in r.value, r.value


def _stages_restored_with_split_state_on_rank_1_only(rank: int, world: int, root: str) -> str:
    torch.manual_seed(rank)
    stage = torch.nn.ModuleDict({f"layer{rank}": torch.nn.Linear(4, 4)})  # each rank its own layer
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), split_state=True, handle_signals=False, timeout=20) as mgr:
        mgr.save(1, {"model": stage})
    try:
        with tg.CheckpointManager(root, split_state=rank == 1, handle_signals=False, timeout=20) as mgr:
            mgr.restore({"model": stage})
    except tg.CheckpointError as e:
        return f"{e.permanent} {type(e).__name__}: {e}"
    return "restored"


def test_pipeline_stages_restored_with_split_state_on_some_ranks_only_say_so_on_every_rank(tmp_path):
    """Stages whose rank 0 forgot the flag: rank 0's state does not fit (StateMismatchError) and rank 1
    went on. Every rank now raises the same error naming split_state, permanent (no restart fixes it),
    and ``restore`` does not try an older checkpoint for it."""
    res = run_ranks(_stages_restored_with_split_state_on_rank_1_only, 2, str(tmp_path / "run"), timeout=90, check=False)
    assert [r.error for r in res] == [None, None], [r.error for r in res]
    assert res[0].value == res[1].value, [r.value for r in res]
    assert res[0].value.startswith("True CheckpointError: load: rank(s) [1] passed split_state=True"), res[0].value
    assert not _events(str(tmp_path / "run"), "restore_skip")
