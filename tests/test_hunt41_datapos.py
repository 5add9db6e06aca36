"""Hunt 41 (datapos): the generators that ``SeededDataset`` and ``ResumableIterable(seed=)`` seed
for each sample must draw independent streams. Python ``random`` and NumPy's global generator were
both seeded with MT19937's ``init_by_array`` of the same two 32-bit words, so they drew the same
numbers (``random.random() == np.random.rand()`` for every sample): two augmentations drawn from
the two generators (a flip from one, a crop from the other) always came together."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg


class _Draws(Dataset):
    """One draw from each global generator, as an augmentation pipeline mixing them does."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), torch.rand(1).item()


def _independent(rows: list[tuple[float, ...]]) -> None:
    py, npy = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    assert not np.any(py == npy), f"{int(np.sum(py == npy))} of {len(rows)} samples drew the same from random and numpy"
    both = int(np.sum((py < 0.5) & (npy < 0.5)))  # two coin flips: about a quarter come up together
    assert abs(both - len(rows) / 4) < 0.1 * len(rows), both
    assert abs(np.corrcoef(py, npy)[0, 1]) < 0.2


def test_seeded_dataset_draws_independent_streams_and_stays_reproducible():
    ds = tg.SeededDataset(_Draws(), seed=0)
    rows = [ds[(i, 0)] for i in range(400)]
    _independent(rows)
    assert rows[7] == ds[(7, 0)] and rows[7] != ds[(7, 1)]  # still a function of (seed, epoch, index)


def test_collate_draws_in_a_worker_are_independent_too():
    def collate(samples: list) -> tuple[float, float]:
        return random.random(), float(np.random.rand())

    sampler = tg.ResumableSampler(400, seed=1, with_epoch=True, rank=0, world_size=1)
    loader = DataLoader(tg.SeededDataset(_Draws(), seed=2), batch_size=1, sampler=sampler, num_workers=1,
                        collate_fn=collate, generator=torch.Generator(), multiprocessing_context="fork")
    _independent(list(loader))


def test_a_seeded_iterable_transform_draws_independent_streams():
    def transform(i: int) -> tuple[float, float]:
        return random.random(), float(np.random.rand())

    data = tg.ResumableIterable(lambda epoch: iter(range(400)), rank=0, world_size=1, transform=transform, seed=3)
    rows = list(data)
    _independent(rows)
    assert rows == list(tg.ResumableIterable(lambda epoch: iter(range(400)), rank=0, world_size=1,
                                             transform=transform, seed=3))
