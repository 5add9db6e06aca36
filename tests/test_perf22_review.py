"""What a save leaves in the page cache (storage.local._LocalWriter.finish): a file written
mostly with O_DIRECT keeps none of the buffered pages around its chunks' direct pages (left
there, they made a later read-in of the file costlier to load from); a file written buffered
keeps its pages, so the next load of it still reads from the page cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import io
from trainguard.storage import _pagecache


def _state() -> dict[str, torch.Tensor]:
    """Large tensors whose lengths end mid-page (buffered bytes around their direct pages) and
    small ones: every data file stays under 16 MiB, so ``cached_fraction`` counts all of it."""
    torch.manual_seed(0)
    return {
        "a": torch.randn((1 << 20) + 123),
        "s": torch.randn(1000),
        "b": torch.randn((1 << 20) + 7),
        "c": torch.randn(300_001),
    }


def _fractions(ckpt: Path) -> list[float]:
    out = []
    for f in sorted(ckpt.iterdir()):
        if f.name.startswith("data"):
            fd = os.open(f, os.O_RDONLY)
            try:
                frac = _pagecache.cached_fraction(fd)
            finally:
                os.close(fd)
            if frac is None:
                pytest.skip("cachestat is not available here")
            assert os.path.getsize(f) <= _pagecache.SAMPLES * _pagecache.SAMPLE_BYTES
            out.append(frac)
    assert out
    return out


def test_direct_save_leaves_no_pages_of_its_files_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "1")
    state = _state()
    before = io.counters()["bytes_direct"]
    tg.save(tmp_path / "c", state)
    if io.counters()["bytes_direct"] - before < sum(v.nbytes for v in state.values()) * 9 // 10:
        pytest.skip("this filesystem refuses O_DIRECT (the save went buffered)")
    assert _fractions(tmp_path / "c") == [0.0] * len(_fractions(tmp_path / "c"))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "c", out)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_buffered_save_keeps_its_files_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "0")
    tg.save(tmp_path / "c", _state())
    assert min(_fractions(tmp_path / "c")) >= 0.9  # the next load reads from the page cache
