"""An async save whose background staging fails partway waits for the device copies it already
started before its staging buffer is released (``BatchCopier.settle``). On the CPU through a seam:
a stand-in for a CUDA stream records ``synchronize``; before, a copy or writer failing partway
through a batch released the pool's buffer with the batch's non-blocking GPU copies still writing
into it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import stage, stagecopy
from trainguard.stagecopy import BatchCopier


class _Stream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("sync")


def _items(n: int) -> list[tuple[int, torch.Tensor, bool, int]]:
    return [(i, torch.full((4096,), i, dtype=torch.uint8), False, 0) for i in range(n)]


def test_a_copy_raising_partway_waits_for_the_device_copies_started() -> None:
    log: list[str] = []
    copier = BatchCopier({})
    copier.streams[0] = _Stream(log)
    calls = []

    def copy(slot: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        return slot.copy_(src)

    gen = copier.batches(_items(3), torch.empty(1 << 20, dtype=torch.uint8), block=4096, copy=copy,
                         flush=lambda: None, last=lambda: None)
    with pytest.raises(RuntimeError, match="copy failed"):
        list(gen)
    assert log == ["sync"]


def test_a_writer_that_stops_after_a_batch_waits_for_the_copies_of_the_next(tmp_path: Path) -> None:
    log: list[str] = []
    copier = BatchCopier({})
    copier.streams[0] = _Stream(log)
    gen = copier.batches(_items(4), torch.empty(8192, dtype=torch.uint8), block=4096, copy=copier.copy,
                         flush=copier.flush, last=lambda: None)
    first = next(gen)  # two chunks fill the buffer: a batch, flushed (one sync)
    assert [i for i, _o, _b in first] == [0, 1] and log == ["sync"]
    gen.close()  # the writer failed: the generator ends at its yield
    assert log == ["sync", "sync"]


def test_a_cpu_copy_failing_in_flush_still_waits_for_the_device_streams() -> None:
    log: list[str] = []
    copier = BatchCopier({})
    copier.streams[0] = _Stream(log)
    copier.queued.append((torch.empty(8, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8)))  # sizes differ
    with pytest.raises(ValueError, match="cannot memmove"):
        copier.flush()
    assert log == ["sync"]


def test_an_async_save_whose_staging_fails_syncs_before_its_buffer_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    init = BatchCopier.__init__

    def with_stream(self: BatchCopier, events: object) -> None:
        init(self, events)  # type: ignore[arg-type]
        self.streams[0] = _Stream(log)  # as if a GPU's tensor was among the chunks

    flushes = []
    copy_many = stagecopy.copy_many

    def failing(pairs: object, threads: int = 2) -> None:
        flushes.append(1)
        if len(flushes) == 2:
            raise OSError(5, "Input/output error")
        copy_many(pairs, threads)  # type: ignore[arg-type]

    release = stage.StagingPool.release

    def logged_release(self: stage.StagingPool) -> None:
        log.append("release")
        release(self)

    monkeypatch.setattr(BatchCopier, "__init__", with_stream)
    monkeypatch.setattr(stagecopy, "copy_many", failing)
    monkeypatch.setattr(stage.StagingPool, "release", logged_release)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = tg.save(tmp_path / "ck", {"model": model, "optim": opt}, async_=True, stage_in_background=True,
                max_staging_bytes=1 << 20)
    with pytest.raises(tg.CheckpointError):
        h.result(timeout=60)
    assert "release" in log and "sync" in log[: log.index("release")]
    assert log.count("sync") >= 2  # the first batch's flush, and the settle after the failed one
    assert not (tmp_path / "ck").exists()  # nothing that looks like a checkpoint
