"""Review of the day's new code other than split_state (review newcode17): the sampler's
advance() warning, the live-iterator refusal, the data position check, the RAM tier's room."""

from __future__ import annotations

import warnings

import pytest
from torch.utils.data import DataLoader

import trainguard as tg


def _advance_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if "advance(n) was not called" in str(w.message)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_into_the_last_partial_batch_skipped_by_drop_last_does_not_warn(num_workers):
    """A DataLoader(drop_last=True) resumed from a checkpoint taken after the epoch's last full
    batch: the sampler yields the few samples left, the loader drops them as a partial batch, and
    the loop rightly advances nothing. next_epoch() warned "advance(n) was not called" (a loop
    that calls it); the warning is for a position that stays at the epoch's start."""
    s = tg.ResumableSampler(10, seed=0, rank=0, world_size=1)
    s.load_state_dict({"epoch": 0, "position": 8, "seed": 0, "num_samples": 10, "shuffle": True})
    loader = DataLoader(list(range(10)), batch_size=4, sampler=s, drop_last=True, num_workers=num_workers)
    seen: list[int] = []

    def loop() -> None:
        for _epoch in range(2):
            for x in loader:
                seen.extend(x.tolist())
                s.advance(len(x))
            s.next_epoch()

    assert _advance_warnings(loop) == []
    assert len(seen) == 8 and s.epoch == 2  # epoch 0: nothing left in full batches; epoch 1: two batches


def test_an_epoch_read_from_its_start_without_advance_still_warns():
    """The case the warning is for, with drop_last=True too: a loop that never calls advance()."""
    s = tg.ResumableSampler(10, seed=0, rank=0, world_size=1)
    loader = DataLoader(list(range(10)), batch_size=4, sampler=s, drop_last=True)

    def loop() -> None:
        for _epoch in range(2):
            for _x in loader:
                pass
            s.next_epoch()

    msgs = _advance_warnings(loop)
    assert len(msgs) == 1 and "epoch 0" in msgs[0]


def _eight(epoch: int) -> range:
    """A module-level stream (pickled to the ranks): 8 items per epoch."""
    return range(8)


def forked_worker_items(rank: int, world: int, ds: tg.ResumableIterable) -> dict[int, list[int]]:
    """``ds`` came pickled from the launcher (as with ``mp.spawn(train, args=(ds,))``): read it
    in the main process and through one forked DataLoader worker."""
    return {nw: [int(x) for x in DataLoader(ds, batch_size=None, num_workers=nw,
                                            multiprocessing_context="fork" if nw else None)] for nw in (0, 1)}


def test_an_iterable_pickled_before_the_process_group_reads_its_rank_share_in_a_forked_worker():
    """``ResumableIterable.__getstate__`` (3a38023) records the pickling process's rank and world
    size for spawned workers. A launcher that pickles the dataset to its ranks has no group: its
    (0, 1) travelled along, and a forked worker (which has its rank's group) used it: every rank
    read the whole stream. The group of the worker's own process comes first now."""
    from dist_helper import run_ranks

    a, b = (r.value for r in run_ranks(forked_worker_items, 2, tg.ResumableIterable(_eight), timeout=90))
    assert a == {0: [0, 2, 4, 6], 1: [0, 2, 4, 6]}
    assert b == {0: [1, 3, 5, 7], 1: [1, 3, 5, 7]}


def test_a_failed_ram_room_round_is_a_failed_save_under_on_error_warn(tmp_path, monkeypatch):
    """``RamTier.target`` agrees in a round ("ram_room", 8151362) whether the save goes to RAM. With
    2 gloo ranks and rank 0 held in the previous step's copy to disk past the timeout, that round
    failed with a RankFailureError that ``save()`` raised on every rank despite on_error="warn"
    (before, the same wait failed the save's "begin" round: a warning, training went on). Here the
    round's failure is injected in one process; the next save goes through."""
    import os

    from trainguard import tiers
    from trainguard.errors import RankFailureError

    def lost(tier, step, timeout, state=None):  # goes_durable's signature (state: the first save's size)
        raise RankFailureError("ram_room: rank(s) [0] did not arrive within 18 s", {0: "did not call ram_room"})

    real = tiers.goes_durable
    monkeypatch.setattr(tiers, "goes_durable", lost)
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    model = tg.StateDict(step=0)
    with warnings.catch_warnings(record=True) as seen, tg.CheckpointManager(
            root, save=tg.EveryNSteps(1), ram_tier=base, on_error="warn", handle_signals=False) as mgr:
        warnings.simplefilter("always")
        assert mgr.save(1, {"progress": model}) is None
        monkeypatch.setattr(tiers, "goes_durable", real)
        assert mgr.save(2, {"progress": model}) is not None
    assert [str(w.message)[:40] for w in seen if "ram_room" in str(w.message)  # base is on disk: the ram_tier warning
            and not str(w.message).startswith("ram_tier: ")] == ["save of step 1 failed (on_error='warn'):"]
    assert sorted(os.listdir(root)) == [".lock", ".trainguard-run-id", "events.jsonl", "step-000000002"]
    with pytest.raises(RankFailureError), tg.CheckpointManager(  # on_error="raise": raised, as before
            root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        mgr.restore({"progress": model})
        monkeypatch.setattr(tiers, "goes_durable", lost)
        mgr.save(3, {"progress": model})
