"""Hostile review of async save (session 57, review57d): the staging pool of two async managers
with different ``max_staging_bytes`` in one process (a model's and an EMA's); and the cases of
"the checkpoint holds the state at the call" no other test covered (a compiled step or model, a
param group added before the next step).

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


# The matrix of promise 1 (the checkpoint holds the state at the call) that no other test covered: the
# step runs in another thread while the save thread's copies are held; it must block in the pre-step hook
# (h.waiting set), and the checkpoint must hold the values at the call.
def _held_step(h_box: list, step) -> None:
    import threading

    t = threading.Thread(target=step, daemon=True)
    t.start()
    assert h_box[0].waiting.wait(30), "step() did not wait for the save's copies"
    h_box[1].set()
    t.join(60)
    assert not t.is_alive()


@pytest.mark.parametrize("case", ["compiled_step", "add_param_group", "compiled_model"])
def test_step_after_save_waits_and_the_checkpoint_holds_the_call(tmp_path, monkeypatch, case):
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    step = torch.compile(optim.step, backend="eager") if case == "compiled_step" else optim.step
    run = torch.compile(model, backend="eager") if case == "compiled_model" else model
    run(torch.randn(4, 16)).sum().backward()
    step()
    state = {"model": run, "optim": optim}
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optim.state.values()]
    gate = threading.Event()
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
    h = tg.save(tmp_path / "a", state, async_=True)
    extra = nn.Linear(16, 16)

    def mutate() -> None:
        if case == "add_param_group":
            optim.add_param_group({"params": extra.parameters()})
        run(torch.randn(4, 16)).sum().backward()  # BatchNorm's statistics too: copied in the call
        step()

    _held_step([h, gate], mutate)
    h.result(timeout=60)
    assert not torch.equal(model[0].weight, at_call["0.weight"])  # the step ran
    fresh = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    tg.load(tmp_path / "a", {"model": torch.compile(fresh, backend="eager") if case == "compiled_model" else fresh,
                              "optim": fresh_opt})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_call[k]), k
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(fresh_opt.state.values(), moments, strict=True))


def test_a_wait_for_another_managers_save_is_the_previous_saves_wait(tmp_path, monkeypatch):
    """``stall_prev_s`` is the part of the call spent waiting for the previous save in flight; an EMA
    manager's save is one (one save in flight per process). Before, only the manager's own previous
    save counted: 0 here, and its DalyInterval took the whole wait as the save's own cost."""
    import json
    import threading

    from trainguard.handle import SaveHandle

    torch.manual_seed(0)
    model, ema = nn.Linear(16, 16), nn.Linear(16, 16)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    opts = dict(save=tg.EveryNSteps(1), async_save=True, handle_signals=False)
    gate, joining = threading.Event(), threading.Event()
    real_join = SaveHandle.join

    def join(self, limit=None):
        if threading.current_thread().name == "model-save":
            joining.set()  # the model's save() waits for the EMA's save from here on
        return real_join(self, limit)

    monkeypatch.setattr(SaveHandle, "join", join)
    with tg.CheckpointManager(tmp_path / "m", **opts) as a, tg.CheckpointManager(tmp_path / "e", **opts) as b:
        a.save(1, {"model": model, "optim": optim})
        a.wait()
        monkeypatch.setattr(async_save, "_before_background_stage", lambda: gate.wait(60))
        b.save(1, {"ema": ema})  # held until the model's save waits for it
        t = threading.Thread(target=a.save, args=(2, {"model": model, "optim": optim}), name="model-save", daemon=True)
        t.start()
        assert joining.wait(60)
        gate.set()
        t.join(60)
        assert not t.is_alive()
    saves = [e for e in map(json.loads, (tmp_path / "m" / "events.jsonl").read_text().splitlines()) if e["event"] == "save"]
    s2 = next(e for e in saves if e["step"] == 2)
    assert 0 < s2["stall_prev_s"] <= s2["stall_call_s"], s2
