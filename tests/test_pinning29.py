"""The staging pool page-locks its arenas only once this process has initialised CUDA, not when
CUDA is merely available. Seen on an H200 (torch 2.11): a CPU-trained process whose async save
page-locked the pool had a CUDA context, and a process it forked then failed in torch's CPU
``optimizer.step()`` (a CUDA error; torch's optimizer asks for the current CUDA stream). Here
CUDA's presence is simulated (``torch.cuda.is_available`` patched): a page-locked allocation
cannot be made on this CPU build of torch, so any attempt fails loudly."""

from __future__ import annotations

import torch

import trainguard as tg
from trainguard import stage
from trainguard.stage import StagingPool


def test_pool_pins_only_once_cuda_is_in_use_and_then_once(monkeypatch):
    pinned: list[int] = []
    real_empty = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):  # records page-locked requests
        if pin_memory:
            pinned.append(args[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    pool = StagingPool()
    pool.acquire([1000])
    pool.buffer(5000)
    pool.release()
    assert not pool.pin and pinned == [] and pool.allocations == 2
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the model went to the GPU
    for _ in range(3):
        pool.acquire([1000])
        pool.buffer(3000)  # smaller than the arena: it is re-made pinned at its old size, once
        pool.release()
    assert pool.pin and pool.allocations == 4
    assert len(pinned) == 2 and pinned[1] >= 5000
    assert StagingPool(pin=False).pin is False and StagingPool(pin=True).pin is True


def test_async_save_of_a_cpu_state_with_cuda_available_does_not_page_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(stage, "_DEFAULT", {})  # a fresh process-wide pool, made under CUDA's presence
    model = torch.nn.Linear(256, 256)
    state = {"model": model, "step": tg.StateDict(step=3)}
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    tg.save(tmp_path / "a", state, async_=True).result(timeout=60)
    assert stage._DEFAULT and not any(p.pin for p in stage._DEFAULT.values())
    back = torch.nn.Linear(256, 256)
    assert not torch.equal(back.weight, at_call["weight"])
    tg.load(tmp_path / "a", {"model": back, "step": tg.StateDict(step=0)})
    assert all(torch.equal(back.state_dict()[k], v) for k, v in at_call.items())
