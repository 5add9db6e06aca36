"""The RAM tier's copy to the run directory (``tiers._copy``, rank 0's persist thread) writes a
local run directory with O_DIRECT: the tmpfs mapping and the file agree modulo a page, so whole
pieces go direct. Buffered, the copy of ``bench.ram_tier``'s 3 GB state took 12-13 s on this
machine against 1.0-1.1 s direct (a manager with ``ram_tier=True``, session 26). A kernel that refuses O_DIRECT gets a buffered
copy, whole; either way the durable copy restores bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_consolidate26 import _direct_ok  # tests/ is on sys.path under pytest
from test_direct_io import _refuse_o_direct
from trainguard.storage import local
from trainguard.tiers import ram_dir


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # 20 MB: large tensors and a small one
    return {"a": torch.randn(3 << 20), "b": torch.randn(2 << 20), "s": torch.randn(1000)}


def _finished(monkeypatch, under: str) -> list[tuple[str, int, int]]:
    """(path, bytes written direct, size) of every file under ``under`` that a writer finishes."""
    seen: list[tuple[str, int, int]] = []
    real = local._LocalWriter.finish

    def finish(self, size: int) -> None:
        if self.path.startswith(under):
            seen.append((self.path, self.direct_bytes, size))
        real(self, size)

    monkeypatch.setattr(local._LocalWriter, "finish", finish)
    return seen


def _save_in_ram_then_restore_from_disk(tmp_path: Path) -> None:
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    Path(base).mkdir()
    state = _state()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base) as mgr:
        mgr.save(1, {"model": tg.StateDict(**state)})
        mgr.ram.wait()  # the copy to the run directory
        assert mgr.ram.persisted == 1
    shutil.rmtree(ram_dir(root, base), ignore_errors=True)  # only the durable copy is left
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert not any(torch.equal(out[k], state[k]) for k in state)
    with tg.CheckpointManager(root, ram_tier=base) as mgr:
        assert mgr.restore({"model": tg.StateDict(**out)}) == 1
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert tg.verify(Path(root) / "step-000000001").ok


def test_the_copy_to_the_run_directory_goes_direct(tmp_path: Path, monkeypatch):
    if not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    seen = _finished(monkeypatch, str(tmp_path / "run"))
    _save_in_ram_then_restore_from_disk(tmp_path)
    data = [(p, d, n) for p, d, n in seen if Path(p).name.startswith("data-")]
    assert data and sum(n for _p, _d, n in data) >= 20 << 20, seen  # the state's bytes were copied
    for path, direct, size in data:
        assert direct >= size * 9 // 10, f"{path}: {direct} of {size} bytes went direct"


def test_a_kernel_refusing_o_direct_gets_a_whole_buffered_copy(tmp_path: Path, monkeypatch):
    seen = _finished(monkeypatch, str(tmp_path / "run"))
    refused = _refuse_o_direct(monkeypatch, "pwrite", at_open=False)
    _save_in_ram_then_restore_from_disk(tmp_path)
    data = [(p, d, n) for p, d, n in seen if Path(p).name.startswith("data-")]
    assert data and all(d == 0 for _p, d, _n in data), data
    assert refused  # O_DIRECT descriptors were opened, and every write on them was refused
