"""docs/data.md's claim about ``SeededDataset``'s seeds: Python's and NumPy's generators take all 64
bits of a sample's seed, torch's CPU generator only the low 32 (torch's mt19937 takes a 32-bit seed)."""

from __future__ import annotations

import random

import numpy as np
import torch

from trainguard.seeded import seeded_call


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seeds_that_differ_above_bit_32_differ_in_python_and_numpy_draws_only():
    low = 0x1234_5678
    a = seeded_call(low, _draws)
    b = seeded_call(low + (7 << 32), _draws)
    assert a[0] != b[0] and a[1] != b[1]  # all 64 bits
    assert a[2] == b[2]  # torch: the low 32 bits (docs/data.md says so)
    assert seeded_call(low, _draws) == a  # a function of the seed alone


def test_torch_draws_under_a_64_bit_seed_are_those_of_its_low_32_bits():
    x = seeded_call((5 << 32) | 9, torch.rand, 3)
    assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(9)))
