"""Load-path cases found in review: each failed before its fix. One process."""

from __future__ import annotations

import warnings

import torch

import trainguard as tg


def test_a_view_read_through_staging_before_a_later_view_still_loads_in_path_order(tmp_path):
    # "a" (a strided view: staged, copied in after the reads) comes first in path order, "b"
    # (contiguous: read in place) second; "b" must win where they overlap, as when both are
    # contiguous. Before, "b" was read first and "a"'s copy overwrote every other element.
    tg.save(tmp_path / "c", {"a": torch.ones(5), "b": torch.arange(10.0)})
    base = torch.zeros(10)
    tg.load(tmp_path / "c", {"a": base[::2], "b": base})
    assert base.tolist() == [float(i) for i in range(10)]

    # "c" is "a" saved as a tie (an alias, the same bytes): it is not skipped as read already,
    # since "b" is copied over part of it in between.
    x = torch.arange(10.0)
    tg.save(tmp_path / "d", {"a": x, "b": torch.full((5,), -1.0), "c": x})
    base = torch.zeros(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "a" and "c" hold the same values: no warning says otherwise
        tg.load(tmp_path / "d", {"a": base, "b": base[::2], "c": base})
    assert base.tolist() == x.tolist()
