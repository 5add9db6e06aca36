"""A rank with no saved RNG state (the world grew) is re-seeded from (reseed, rank, the
checkpoint's step): reproducible from the same checkpoint, and a rank added again at a later
growth draws a new stream instead of replaying the one it drew after the first growth. The
end-to-end path (2 ranks saved, 3 load) is in test_dist_fsdp.py."""

from __future__ import annotations

import random

import numpy as np
import torch

import trainguard as tg
from trainguard.rankload import _reseed


def _draws(reseed: int, rank: int, step: int) -> tuple:
    tg.RNGState(reseed=reseed).reseed_for_rank(rank, step=step)
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_reseed_depends_on_the_step_and_is_reproducible():
    first, again, later = _draws(0, 2, 8), _draws(0, 2, 8), _draws(0, 2, 18)
    assert first == again
    assert all(a != b for a, b in zip(first, later)), "a later growth replayed the first growth's stream"
    assert _draws(0, 3, 8) != first and _draws(1, 2, 8) != first
    # Not torch.manual_seed(rank), the common convention of training scripts: a new rank must not
    # replay the stream rank 2 drew at step 0 of the run.
    torch.manual_seed(2)
    assert torch.rand(4).tolist() != first[0]


def test_user_objects_with_the_old_signature_still_work():
    class Old:
        def reseed_for_rank(self, rank):
            self.got = (rank,)

    class New:
        def reseed_for_rank(self, rank, step=0):
            self.got = (rank, step)

    class Kw:
        def reseed_for_rank(self, rank, **kw):
            self.got = (rank, kw)

    old, new, kw = Old(), New(), Kw()
    for obj in (old, new, kw):
        _reseed(obj, 5, 700)
    assert old.got == (5,) and new.got == (5, 700) and kw.got == (5, {"step": 700})
