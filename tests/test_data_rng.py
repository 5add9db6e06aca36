"""Randomness of the data pipeline across a resume (docs/data.md, "Randomness in the data
pipeline"): a DataLoader with its own generator leaves the global torch RNG to the training step,
and ``SeededDataset`` makes augmentation drawn in DataLoader workers reproducible."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import trainguard as tg


class Augmented(Dataset):
    """Each item draws from torch, NumPy and Python random, as augmentations do."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i)) + torch.randn(4) + float(np.random.rand()) + random.random()


def _seeded_loader(workers: int, persistent: bool = False) -> tuple[dict, DataLoader]:
    sampler = tg.ResumableSampler(32, seed=3, with_epoch=True)
    loader = DataLoader(tg.SeededDataset(Augmented(), seed=3), batch_size=4, sampler=sampler, num_workers=workers,
                        persistent_workers=persistent, generator=torch.Generator())
    return {"data": sampler, "rng": tg.RNGState()}, loader


def _consume(state: dict, loader: DataLoader, steps: int, save_at: int | None = None, path: str = "") -> list:
    out = []
    while len(out) < steps:
        for x in loader:
            state["data"].advance(len(x))
            out.append(x)
            if len(out) == save_at:
                tg.save(path, state)
            if len(out) == steps:
                break
        else:
            state["data"].next_epoch()
    return out


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_augmentation_resumes_bit_identically(tmp_path, persistent):
    # 12 batches: the epoch (8 batches) ends and the next one starts after the resume at 5.
    straight = _consume(*_seeded_loader(2, persistent), steps=12, save_at=5, path=str(tmp_path / "step-5"))
    state, loader = _seeded_loader(2, persistent)
    tg.load(str(tmp_path / "step-5"), state)
    resumed = _consume(state, loader, steps=7)
    assert all(torch.equal(a, b) for a, b in zip(straight[5:], resumed, strict=True))
    # Each (epoch, index) has its own draws; the same key always the same.
    ds = tg.SeededDataset(Augmented(), seed=3)
    assert torch.equal(ds[(5, 0)], ds[(5, 0)]) and not torch.equal(ds[(5, 0)], ds[(5, 1)])


def test_seeded_dataset_is_independent_of_workers_and_keeps_the_callers_rng():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    in_process = _consume(*_seeded_loader(0), steps=8)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    in_workers = _consume(*_seeded_loader(2), steps=8)
    assert all(torch.equal(a, b) for a, b in zip(in_process, in_workers, strict=True))


def test_seeded_dataset_leaves_cuda_generators_alone(monkeypatch):
    """Only the CPU generator is seeded (and restored): torch.manual_seed would also reseed every
    CUDA device, whose state SeededDataset does not restore (dropout on the GPU with
    num_workers=0 would then draw from the sample's seed)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(seed))
    first = tg.SeededDataset(Augmented(), seed=3)[(5, 1)]
    assert calls == [] and torch.equal(first, tg.SeededDataset(Augmented(), seed=3)[(5, 1)])


def test_seeded_dataset_refuses_plain_indices():
    with pytest.raises(TypeError, match="with_epoch=True"):
        tg.SeededDataset(Augmented())[3]


def test_documented_loader_with_dropout_resumes_bit_identically(tmp_path):
    """A DataLoader draws a base seed from its generator each time its iterator is created; with
    the global generator, the resumed run's draw (mid-epoch, after restore) shifts dropout."""
    ds = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))

    def build() -> tuple[dict, DataLoader]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
        sampler = tg.ResumableSampler(ds, seed=0)
        state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "data": sampler,
                 "rng": tg.RNGState()}
        return state, DataLoader(ds, batch_size=4, sampler=sampler, generator=torch.Generator())

    def train(state: dict, loader: DataLoader, steps: int, save_at: int | None = None) -> list[float]:
        losses: list[float] = []
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(state["model"](x), y)
            state["optim"].zero_grad()
            loss.backward()
            state["optim"].step()
            state["data"].advance(len(x))
            losses.append(loss.item())
            if len(losses) == save_at:
                tg.save(str(tmp_path / "step-3"), state)
            if len(losses) == steps:
                break
        return losses

    straight = train(*build(), steps=6, save_at=3)
    state, loader = build()
    tg.load(str(tmp_path / "step-3"), state)
    assert train(state, loader, steps=3) == straight[3:]
