"""CUDA paths (skipped without a GPU; run on the device machine): async staging into pinned
host memory on a side stream, the pre-step hook with kernels still queued, per-device RNG,
sync save/load of CUDA tensors, and a bit-identical resume of a CUDA training loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.stage import default_pool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make(seed: int = 0, width: int = 256) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}


def step(state: dict) -> torch.Tensor:
    x = torch.randn(128, 64, device="cuda")  # the CUDA generator: restored by RNGState
    loss = state["model"](x).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["progress"]["step"] += 1
    return loss.detach()


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.detach().cpu().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optim"].state.values()):
        for k, v in s.items():
            out[f"o/{i}/{k}"] = v.detach().cpu().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_save_stages_pinned_and_holds_state_at_call_despite_queued_kernels(tmp_path):
    state = make()
    for _ in range(3):
        step(state)
    # Queue a lot of GPU work that mutates the parameters *before* the save: the save must see
    # its result (the copies wait on an event recorded on the current stream at the call).
    with torch.no_grad():
        for _ in range(50):
            for p in state["model"].parameters():
                p.mul_(1.0001)
    torch.cuda.synchronize()
    at_call = snapshot(state)
    h = tg.save(tmp_path / "a", state, async_=True)
    for _ in range(5):  # training goes on at once; step() waits in the pre-step hook if needed
        step(state)
    assert not same(snapshot(state), at_call)
    h.result(timeout=120)
    pool = default_pool()
    assert pool.pin and pool._background is not None and pool._background.is_pinned()
    print(f"\nCUDA async save: call {h.call_s:.4f} s, pre-step wait {h.hook_wait_s:.4f} s")
    fresh = make(seed=1)
    assert not same(snapshot(fresh), at_call)
    tg.load(tmp_path / "a", fresh)
    assert same(snapshot(fresh), at_call)
    assert next(fresh["model"].parameters()).is_cuda


def test_cuda_rng_of_every_device_round_trips(tmp_path):
    torch.cuda.manual_seed_all(123)
    torch.randn(10, device="cuda")
    tg.save(tmp_path / "r", {"rng": tg.RNGState()})
    expect = [torch.randn(1000, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed_all(7)
    assert not torch.equal(torch.randn(1000, device="cuda:0").cpu(), expect[0])
    tg.load(tmp_path / "r", {"rng": tg.RNGState()})
    got = [torch.randn(1000, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


def test_sync_and_async_resume_is_bit_identical_on_cuda(tmp_path):
    for async_ in (False, True):
        state = make()
        losses = []
        h = None
        for i in range(1, 13):
            losses.append(step(state).cpu())
            if i == 6:
                h = tg.save(tmp_path / f"c{async_}", state, async_=async_)
        if h is not None and async_:
            h.result(timeout=120)
        resumed = make(seed=5)
        tg.load(tmp_path / f"c{async_}", resumed)
        assert resumed["progress"]["step"] == 6
        again = [step(resumed).cpu() for _ in range(6)]
        assert all(torch.equal(a, b) for a, b in zip(again, losses[6:], strict=True)), f"async={async_}"


def test_large_cuda_state_async_stall_is_small(tmp_path):
    """~1 GB of CUDA parameters + AdamW: the call returns after the sync part; the background
    copies and the write run while training goes on. Prints the figures (no timing assert)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt}
    x = torch.randn(256, 4096, device="cuda")

    def train() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    train()
    torch.cuda.synchronize()
    at_call = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    import time

    t0 = time.perf_counter()
    h = tg.save(tmp_path / "big", state, async_=True)
    call = time.perf_counter() - t0
    for _ in range(3):
        train()
    h.result(timeout=300)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    tg.save(tmp_path / "big-sync", state)
    sync_s = time.perf_counter() - t1
    print(f"\n{h.bytes / 1e9:.2f} GB: async call {call:.4f} s + pre-step wait {h.hook_wait_s:.4f} s; sync save {sync_s:.2f} s")
    fresh = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)]).cuda()
    tg.load(tmp_path / "big", {"model": fresh}, only=["model"])
    assert all(torch.equal(v.cpu(), at_call[k]) for k, v in fresh.state_dict().items())


def test_sync_save_of_cuda_state_stages_through_a_bounded_host_buffer(tmp_path, monkeypatch):
    from trainguard import streams

    monkeypatch.setattr(streams, "HOST_BATCH", 8 << 20)
    monkeypatch.setattr(streams, "_HOST_POOL", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(10 << 20, device="cuda", generator=g), "b": torch.randn(1000, device="cuda", generator=g)}
    tg.save(tmp_path / "c", state)
    assert streams._HOST_POOL.capacity <= 8 << 20  # 40 MiB of state, never more than 8 MiB on the host
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "c", back)
    assert all(torch.equal(back[k], state[k]) for k in state)
