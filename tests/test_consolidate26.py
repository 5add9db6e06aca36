"""``consolidate`` in batches (session 26): a batch's tensors are read in parallel into one reused
page-aligned buffer and written with ``io.write_batches`` (two streams, O_DIRECT on local disks)
instead of one tensor at a time through a buffered writer (3.1 GB GPT + AdamW state here: 8-13 s
before, 4.0-4.7 s after). What must hold: the full checkpoint loads bit for bit whatever the
batches (a tensor larger than a batch, empty and 0-d tensors, odd sizes, several dtypes, a
tie), ``progress`` names each tensor once, and a corrupt source byte fails it with nothing left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_read_pieces import _flip  # tests/ is on sys.path under pytest
from trainguard import consolidate as cons
from trainguard import io
from trainguard.errors import CorruptCheckpointError


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.randn(700_000)  # 2.8 MB: larger than the test's 1 MiB batches, alone in one
    return {
        "big": big,
        "tied": big,  # an alias: stored once, stays an alias
        "a": torch.randn(1000, 257),
        "bf": torch.randn(300_001).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "i8": torch.randint(-100, 100, (12_345,), dtype=torch.int8),
        "b": torch.randn(123, 4567),
    }


@pytest.mark.parametrize("files", [1, 2])
def test_consolidate_in_batches_loads_bit_for_bit(tmp_path: Path, monkeypatch, files: int):
    from trainguard import streams

    monkeypatch.setattr(cons, "GROUP", 1 << 20)
    monkeypatch.setattr(streams, "TWO_FILES_FROM", 1 << 20 if files == 2 else 1 << 40)
    state = _state()
    m = tg.save(tmp_path / "src", state)
    assert len(m.files) == files  # a batch reads from both data files of the source
    seen: list[tuple[str, int]] = []
    before = io.counters()["bytes_direct"]
    cons.consolidate(tmp_path / "src", tmp_path / "full", progress=lambda p, n: seen.append((p, n)))
    stored = [k for k in sorted(state) if k != "tied"]
    assert seen == [(k, state[k].nbytes) for k in stored]  # each tensor once, in the file's order
    assert len(cons._groups(*_layout(state, stored))) > 2  # several batches were written
    sent = io.counters()["bytes_direct"] - before
    assert sent > sum(state[k].nbytes for k in stored) // 2 or not _direct_ok(tmp_path)
    assert tg.verify(tmp_path / "full").ok
    out = {k: torch.full_like(v, 7) if v.numel() else torch.empty_like(v) for k, v in state.items()}
    out["tied"] = out["big"]
    assert not torch.equal(out["a"], state["a"])
    tg.load(tmp_path / "full", out)
    assert all(torch.equal(out[k], state[k]) for k in state)


def _direct_ok(where: Path) -> bool:
    from trainguard.storage.local import LocalStorage

    w = LocalStorage().open_write(str(where / "probe"), direct=True)
    w.abort()
    return w.direct_ok


def _layout(state: dict[str, torch.Tensor], stored: list[str]) -> tuple[list[int], list[int]]:
    from trainguard.planner import layout_file

    sizes = [state[k].nbytes for k in stored]
    return layout_file(sizes)[0], sizes


def test_a_corrupt_source_byte_fails_the_consolidation_and_leaves_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cons, "GROUP", 1 << 20)
    state = _state()
    tg.save(tmp_path / "src", state)
    _flip(tmp_path / "src", "b", 1000)
    with pytest.raises(CorruptCheckpointError, match="b"):
        cons.consolidate(tmp_path / "src", tmp_path / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temp directory, no result
