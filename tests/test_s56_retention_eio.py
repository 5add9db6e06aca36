"""Session 56: retention's damage check (``keptseen.kept_damaged``) after review56i. A failed read or stat (EIO)
tells nothing about a checkpoint: before, one transient EIO on a kept step's data file marked it damaged, and
``KeepEvery(10)`` then kept step 15 for the rest of the process; an EIO reading a kept manifest deleted it."""

from __future__ import annotations

import errno
import os

import torch

import trainguard as tg
from trainguard.storage import LocalStorage


def _steps(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit())


def test_one_eio_on_a_kept_steps_file_neither_deletes_nor_pins_it(tmp_path, monkeypatch) -> None:
    root = str(tmp_path / "run")
    size, failed = LocalStorage.size, []

    def eio_once(self, path, *a, **k):
        if os.path.join("step-000000015", "data-") in path and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", path)
        return size(self, path, *a, **k)

    monkeypatch.setattr(LocalStorage, "size", eio_once)
    state = {"model": torch.nn.Linear(3, 2), "p": tg.StateDict(step=0)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(5), keep=tg.KeepEvery(10), handle_signals=False) as mgr:
        for step in range(5, 45, 5):
            state["p"]["step"] = step
            mgr.save(step, state)
    assert failed, "the stat of step 15's data file was never made: the test does not test retention's check"
    assert _steps(root) == [10, 20, 30, 40]  # before: [10, 15, 20, 30, 40], step 15 kept as damaged for good
