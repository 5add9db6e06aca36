"""Session 47's own fixes, each checked to fail on the code before it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("seed", [1.7, np.float32(2.5), torch.tensor(4.5), float("inf"), float("nan")])
def test_fractional_seed_refused(seed):
    # int() truncated them: seed=1.7 and seed=1.2 shuffled alike, two runs "with different seeds"
    # reading one order. SeededDataset and ResumableIterable's transform seed take the same check.
    with pytest.raises(TypeError, match=r"ResumableSampler\(seed=.*\): pass an int seed \(a whole number"):
        tg.ResumableSampler(10, seed=seed)
    with pytest.raises(TypeError, match=r"ResumableIterable\(seed=.*\): pass an int seed"):
        tg.ResumableIterable(lambda epoch: iter(range(10)), seed=seed, transform=lambda x: x)


def test_whole_seeds_still_taken():
    # What is an int in all but type stays accepted, and gives the order of that int.
    order = list(tg.ResumableSampler(50, seed=7))
    for seed in ("7", 7.0, np.int64(7), torch.tensor(7)):
        assert list(tg.ResumableSampler(50, seed=seed)) == order
    assert tg.ResumableSampler(50, seed=2**64 + 1).seed == 2**64 + 1  # no float round trip
    assert tg.ResumableIterable(lambda epoch: iter(range(3)), seed=np.int64(3)).seed == 3
