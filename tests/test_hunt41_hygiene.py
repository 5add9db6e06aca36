"""The tests' own helpers leave nothing behind (session 41: ~9,700 ``/tmp/tg-ranks-*`` directories
had piled up from earlier runs of the suite, one per ``dist_helper.run_ranks`` call)."""

from __future__ import annotations

import tempfile

from dist_helper import run_ranks


def _rank_value(rank: int, world: int) -> int:
    return rank * 10 + world


def test_run_ranks_returns_each_ranks_value_and_removes_its_result_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    results = run_ranks(_rank_value, 2, timeout=60)
    assert [r.value for r in results] == [2, 12]
    assert list(tmp_path.glob("tg-ranks-*")) == []  # (multiprocessing keeps a pymp-* of its own there)
