"""Hostile review of async save (session 57, review57d): the staging pool of two async managers
with different ``max_staging_bytes`` in one process (a model's and an EMA's).

Before, the process kept one pool and a save with another cap replaced it (``stage.default_pool``):
each manager's save freed the other's arenas and allocated (and touched) its own again, every save
(a ``/tmp`` script, 10 rounds of a model+Adam save and a 64 MB EMA save with a 64 MiB cap: 30 arena
allocations, 1,121 MiB touched, against 3 and 112 MiB with equal caps). Now each open manager's cap
keeps its pool; a cap no open manager uses is dropped as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import async_save, stage


@pytest.fixture(autouse=True)
def _own_pools(monkeypatch):
    monkeypatch.setattr(stage, "_DEFAULT", {})  # this test's pools only
    yield
    job = async_save._INFLIGHT
    if job is not None and job.handle._thread is not None and job.handle._thread.ident is not None:
        job.handle.join(60)


def _arena_allocations(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = stage.aligned_empty

    def counting(n: int, align: int) -> torch.Tensor:
        sizes.append(n)
        return real(n, align)

    monkeypatch.setattr(stage, "aligned_empty", counting)
    return sizes


def test_two_managers_with_different_caps_reuse_their_pools(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    ema = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # no optimizer: copied in the call
    model(torch.randn(4, 256)).sum().backward()
    optim.step()
    sizes = _arena_allocations(monkeypatch)
    opts = dict(save=tg.EveryNSteps(1), async_save=True, handle_signals=False)
    with tg.CheckpointManager(tmp_path / "model", **opts) as a, \
            tg.CheckpointManager(tmp_path / "ema", max_staging_bytes=4 << 20, **opts) as b:
        for step in range(1, 7):
            a.save(step, {"model": model, "optim": optim})
            a.wait()
            b.save(step, {"ema": ema})
            b.wait()
            if step == 2:
                steady = len(sizes)
        assert len(sizes) == steady, f"arenas allocated again in steady state: {sizes[steady:]}"
        assert stage.pool_capacity(4 << 20) <= (4 << 20) + 2 * 256 * 256 * 4 + (1 << 20)  # its cap + its sync copies
    assert a.latest_step() == b.latest_step() == 6
    assert all(p.capacity == 0 for p in stage._DEFAULT.values())  # both closed: freed


def test_a_cap_no_open_manager_uses_is_dropped(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    with tg.CheckpointManager(tmp_path / "m", save=tg.EveryNSteps(1), async_save=True, handle_signals=False,
                              max_staging_bytes=np.int64(8 << 20)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        tg.save(tmp_path / "d1", state, async_=True, max_staging_bytes=1 << 20).result(timeout=60)
        tg.save(tmp_path / "d2", state, async_=True, max_staging_bytes=2 << 20).result(timeout=60)
        caps = sorted(k[0] for k in stage._DEFAULT)
        assert caps == [2 << 20, 8 << 20], caps  # the manager's (a numpy int: one key) and the last direct save's
        mgr.save(2, state)
        mgr.wait()
    assert mgr.latest_step() == 2
