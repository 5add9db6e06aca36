"""A bool passed as a seed is refused with a message naming the argument (it was taken as 0 or 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("seed", [True, False, np.bool_(True), torch.tensor(True)])
def test_bool_seed_is_refused_everywhere(seed: object) -> None:
    data = list(range(10))
    for make in (lambda: tg.ResumableSampler(data, seed=seed, world_size=1, rank=0),
                 lambda: tg.SeededDataset(data, seed=seed)):
        with pytest.raises(TypeError, match=r"a bool is not a seed; pass an int seed"):
            make()


def test_int_like_seeds_still_accepted() -> None:
    data = list(range(10))
    orders = [list(tg.ResumableSampler(data, seed=s, world_size=1, rank=0)) for s in (1, np.int64(1), torch.tensor(1))]
    assert orders[0] == orders[1] == orders[2]
    assert sorted(orders[0]) == data
