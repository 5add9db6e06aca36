"""review57j: hostile review of review57h's "set_epoch/next_epoch forgotten?" warning (false warnings)
and of review57d's staging pools kept per cap."""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard import ResumableIterable, ResumableSampler

N, B = 40, 8


def _reread_warnings(fn) -> int:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return sum("forgotten" in str(w.message) for w in got)


def _epoch(loader, data) -> None:
    for (x,) in loader:
        data.advance(len(x))


def test_a_retry_that_restores_the_latest_state_at_an_epochs_end_is_not_warned():
    # A training loop retried in-process after an error (eval after epoch 0 failed): it restores the
    # latest checkpoint, taken at epoch 0's end, equal to the sampler's state, and starts again at
    # sampler.epoch. Epoch 0 rightly yields nothing, then set_epoch(1) moves on: no set_epoch forgotten.
    ds = TensorDataset(torch.arange(N))
    s = ResumableSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=B, sampler=s)

    def run() -> None:
        s.set_epoch(0)
        _epoch(loader, s)
        s.load_state_dict(s.state_dict())  # the retry's restore: the same state
        for epoch in range(s.epoch, 3):
            s.set_epoch(epoch)
            _epoch(loader, s)

    assert _reread_warnings(run) == 0
    assert s.epoch == 2 and s.position == N


def test_hf_style_replay_of_trained_epochs_after_a_resume_at_an_epochs_end_is_not_warned():
    # transformers' Trainer (< 4.3x) resumed at step k * steps_per_epoch begins an iteration of the
    # loader for each trained epoch (`for _ in train_dataloader: break`), then set_epoch(k). The sampler,
    # restored at epoch k-1's end, yields nothing in each: no epoch is lost, nothing to warn of.
    ds = TensorDataset(torch.arange(N))
    s = ResumableSampler(ds, seed=1)
    s.load_state_dict({"epoch": 2, "position": N, "seed": 1, "num_samples": N, "shuffle": True})
    loader = DataLoader(ds, batch_size=B, sampler=s)

    def run() -> None:
        for _ in range(3):
            for _ in loader:
                break
        for epoch in range(3, 5):
            s.set_epoch(epoch)
            _epoch(loader, s)

    assert _reread_warnings(run) == 0
    assert s.epoch == 4 and s.position == N


def test_iterable_restored_in_process_at_an_epochs_end_is_not_warned():
    data = ResumableIterable(lambda epoch: iter(range(20)), rank=0, world_size=1)
    loader = DataLoader(data, batch_size=4)

    def run() -> None:
        _epoch_it(loader, data)
        data.load_state_dict(data.state_dict())  # a retry's restore of the latest (the same) state
        _epoch_it(loader, data)  # nothing left of epoch 0, rightly
        data.next_epoch()
        _epoch_it(loader, data)

    assert _reread_warnings(run) == 0
    assert data.epoch == 1 and data.position == 20


def _epoch_it(loader, data) -> None:
    for x in loader:
        data.advance(len(x))


def test_a_forgotten_set_epoch_is_still_warned():
    ds = TensorDataset(torch.arange(N))
    s = ResumableSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=B, sampler=s)
    assert _reread_warnings(lambda: [_epoch(loader, s) for _ in range(3)]) == 1
    s2 = ResumableSampler(ds, seed=1)  # after a restore mid-epoch too
    s2.load_state_dict({"epoch": 0, "position": 16, "seed": 1, "num_samples": N, "shuffle": True})
    loader2 = DataLoader(ds, batch_size=B, sampler=s2)
    assert _reread_warnings(lambda: [_epoch(loader2, s2) for _ in range(3)]) == 1
    data = ResumableIterable(lambda epoch: iter(range(20)), rank=0, world_size=1)
    loader3 = DataLoader(data, batch_size=4)
    assert _reread_warnings(lambda: [_epoch_it(loader3, data) for _ in range(3)]) == 1


def test_a_manager_closed_while_another_managers_save_is_in_flight_frees_its_pool_at_the_next_save(tmp_path, monkeypatch):
    # A model manager (no cap) closes while the EMA manager's (capped) save is in flight: close() frees no pool
    # then (a save is in flight). Before, the model's pool (its whole state's arena) stayed held while the EMA
    # manager went on saving, until it closed too: its saves found their own cap's pool and dropped nothing.
    import threading

    import trainguard as tg
    from trainguard import async_save, stage

    monkeypatch.setattr(stage, "_DEFAULT", {})
    monkeypatch.setattr(stage, "_DIRECT", [])  # no earlier test's direct save (review57l: a manager keeps its pool)
    gate, real = threading.Event(), async_save._run

    def held(job, storage, target, *a, **kw):
        if "ema" in str(target):
            assert gate.wait(60)
        return real(job, storage, target, *a, **kw)

    monkeypatch.setattr(async_save, "_run", held)
    model, ema = {"w": torch.randn(1 << 20)}, {"e": torch.randn(1 << 10)}
    opts = dict(save=tg.EveryNSteps(1), async_save=True, handle_signals=False)
    a = tg.CheckpointManager(tmp_path / "model", **opts).open()
    b = tg.CheckpointManager(tmp_path / "ema", max_staging_bytes=1 << 20, **opts).open()
    try:
        a.save(1, model)
        a.wait()
        assert stage.pool_capacity(None) >= 4 << 20
        b.save(1, ema)  # in flight until the gate opens
        a.close()
        gate.set()
        b.wait()
        b.save(2, ema)
        b.wait()
        assert stage.pool_capacity(None) == 0  # the closed manager's arena is not held for the EMA's saves
    finally:
        gate.set()
        a.close()
        b.close()
    assert stage.pool_capacity(None) == 0 and stage.pool_capacity(1 << 20) == 0


def test_the_pool_of_a_tensor_cap_is_found_by_that_cap(tmp_path, monkeypatch):
    # default_pool keys a 0-d tensor (or numpy) cap by its value since review57d; pool_capacity (the RAM tier's room
    # estimate, ramroom.py) looked it up by the tensor itself and always found none (0: the pool counted as free).
    import trainguard as tg
    from trainguard import stage

    monkeypatch.setattr(stage, "_DEFAULT", {})
    cap = torch.tensor(1 << 20)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True, handle_signals=False,
                              max_staging_bytes=cap) as mgr:
        mgr.save(1, {"w": torch.randn(1 << 16)})
        mgr.wait()
        assert stage.pool_capacity(cap) == stage.pool_capacity(1 << 20) > 0
