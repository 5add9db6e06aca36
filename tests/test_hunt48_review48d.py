"""review48d: fresh-eyes review of state capture and the optimizer side (session 48)."""

from __future__ import annotations

import numpy as np
import pytest

import trainguard as tg


def _child(rng: np.random.Generator) -> float:
    return float(rng.spawn(1)[0].random())


def test_numpy_generator_spawn_count_is_restored(tmp_path):
    """A loop that splits its numpy generator with ``spawn()`` (one child per epoch or worker, as
    NumPy recommends) resumes with the children the uninterrupted run makes next. The count lives in
    the generator's SeedSequence, not in ``bit_generator.state``: the old code restored the state only,
    so the resumed run's children were the first epochs' again (the same stream twice, silently)."""
    straight = np.random.default_rng(0)
    expected = [_child(straight) for _ in range(4)][2:]

    rng = np.random.default_rng(0)
    [_child(rng) for _ in range(2)]
    rng.random(3)
    after = np.random.default_rng(0)
    [_child(after) for _ in range(2)]
    after.random(3)
    plain = float(after.random())
    tg.save(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})

    resumed = np.random.default_rng(0)  # as a restarted script builds it
    tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": resumed})})
    assert resumed.bit_generator.seed_seq.n_children_spawned == 2
    assert float(resumed.random()) == plain  # the generator's own stream, as before
    assert [_child(resumed) for _ in range(2)] == [_child(after) for _ in range(2)] == expected


def test_numpy_generator_that_spawned_more_keeps_its_count_and_warns(tmp_path):
    """A generator that has spawned more children than the checkpoint's cannot go back (the count
    only grows): the load says so instead of leaving the next ``spawn()`` off silently."""
    rng = np.random.default_rng(1)
    _child(rng)
    tg.save(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})
    [_child(rng) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"'data' has spawned 3 children .* the checkpoint's 1"):
        tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})
    assert rng.bit_generator.seed_seq.n_children_spawned == 3
