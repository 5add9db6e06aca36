"""Session 46 review (review46b) of the afternoon's merged changes: defects found by real runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainguard as tg


def _epochs(num_workers: int, steps: int, per_step: int | None = None) -> list[str]:
    ds = torch.utils.data.TensorDataset(torch.arange(100.0))
    s = tg.ResumableSampler(ds, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, num_workers=num_workers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for epoch in range(2):
            s.set_epoch(epoch)
            for i, (x,) in enumerate(dl):
                s.advance(len(x) if per_step is None else per_step)
                if i + 1 == steps:  # a steps-per-epoch cap
                    break
    return [str(w.message) for w in seen if "advance" in str(w.message)]


def test_a_capped_epoch_read_ahead_by_worker_processes_is_not_called_a_wrong_advance() -> None:
    # advance(len(x)) after each of 10 steps of 13; two workers had read the sampler to its end
    # ahead of the loop (prefetch): the position (80 of 100) is right, no warning is due.
    assert _epochs(num_workers=2, steps=10) == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_advance_one_per_step_is_still_warned_about(num_workers: int) -> None:
    out = _epochs(num_workers=num_workers, steps=13, per_step=1)
    assert len(out) == 1 and "counted 13 sample(s) in 13 call(s)" in out[0]
