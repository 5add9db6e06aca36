"""``RNGState`` reads the CUDA generators only once this process has initialised CUDA. Reading
them creates a CUDA context: a process that trains on the CPU of a GPU machine got one at its
first save, and CUDA then fails in the processes it forks (the same cause as the staging pool's
page-locking, ``test_pinning29``). Before CUDA is initialised the generators have drawn nothing;
they hold the seed that ``torch.manual_seed`` queued, which a restarted program queues again.
CUDA's presence is simulated here (this torch is a CPU build)."""

from __future__ import annotations

import random

import pytest
import torch

import trainguard as tg


def _fake_cuda(monkeypatch, initialised: bool) -> list[str]:
    calls: list[str] = []

    def get_all():
        calls.append("get_rng_state_all")
        if not initialised:
            raise AssertionError("the CUDA generators were read: that creates a CUDA context")
        return [torch.full((16,), 7, dtype=torch.uint8), torch.full((16,), 9, dtype=torch.uint8)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: calls.append(f"set {i} {int(s[0])}"))
    return calls


def test_cpu_trained_process_saves_and_loads_without_touching_cuda(tmp_path, monkeypatch):
    calls = _fake_cuda(monkeypatch, initialised=False)
    random.seed(5)
    torch.manual_seed(5)
    tg.save(tmp_path / "c", {"rng": tg.RNGState()})
    expect = (random.random(), torch.rand(3))
    random.seed(6)
    torch.manual_seed(6)
    assert random.random() != expect[0]
    tg.load(tmp_path / "c", {"rng": tg.RNGState()})
    assert random.random() == expect[0] and torch.equal(torch.rand(3), expect[1])  # the CPU generators came back
    assert calls == []
    assert "cuda" not in tg.RNGState().state_dict()


def test_cuda_generators_saved_and_restored_once_cuda_is_in_use(tmp_path, monkeypatch):
    calls = _fake_cuda(monkeypatch, initialised=True)
    tg.save(tmp_path / "g", {"rng": tg.RNGState()})
    assert calls == ["get_rng_state_all"]
    tg.load(tmp_path / "g", {"rng": tg.RNGState()})
    sets = [c for c in calls if c.startswith("set")]
    assert sets == ["set 0 7", "set 1 9"]  # each device's own state, back on its device


@pytest.mark.parametrize("initialised", [False, True])
def test_state_dict_keys(monkeypatch, initialised):
    _fake_cuda(monkeypatch, initialised)
    assert ("cuda" in tg.RNGState().state_dict()) is initialised
