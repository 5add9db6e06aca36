"""Defects found by triaging mypy's errors in src/trainguard (session 53, helper mypy53)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("kind", [np.int64, torch.tensor], ids=["numpy", "tensor0d"])
def test_sampler_rank_world_of_numpy_or_tensor_ints_saves_plain_int_position(tmp_path, kind):
    # rank/world_size are typed SupportsIndex (numpy's and a 0-d tensor's ints): before, they were used
    # as given, so advance() made the position a numpy int (tg.save refused it: UnsupportedValueError)
    # or a tensor.
    s = tg.ResumableSampler(10, rank=kind(1), world_size=kind(2), shuffle=False)
    assert list(s) == [1, 3, 5, 7, 9]
    assert s.rank_world == (1, 2) and all(type(v) is int for v in s.rank_world)
    s.advance(2)
    assert type(s.state_dict()["position"]) is int and s.position == 4
    tg.save(tmp_path / "c", {"s": s})
    s2 = tg.ResumableSampler(10, rank=kind(1), world_size=kind(2), shuffle=False)
    tg.load(tmp_path / "c", {"s": s2})
    assert s2.position == 4 and list(s2) == [5, 7, 9]


@pytest.mark.parametrize("kind", [np.int64, torch.tensor], ids=["numpy", "tensor0d"])
def test_iterable_rank_world_of_numpy_or_tensor_ints_saves_plain_int_position(tmp_path, kind):
    it = tg.ResumableIterable(lambda epoch: range(10), rank=kind(0), world_size=kind(2))
    assert list(it) == [0, 2, 4, 6, 8]
    it.advance(1)
    assert type(it.state_dict()["position"]) is int and it.position == 2
    tg.save(tmp_path / "c", {"it": it})
    it2 = tg.ResumableIterable(lambda epoch: range(10), rank=kind(0), world_size=kind(2))
    tg.load(tmp_path / "c", {"it": it2})
    assert it2.position == 2 and list(it2) == [2, 4, 6, 8]


def test_sampler_float_world_size_refused_at_construction():
    with pytest.raises(ValueError, match="need integers 0 <= rank < world_size"):
        tg.ResumableSampler(10, rank=0, world_size=2.0)  # type: ignore[arg-type]
