"""bench.stall's bookkeeping (a tiny model, a few steps; not its figures): each save's part in
the call is kept beside its stall, and a method's run starts after a full garbage collection, so
that garbage an earlier method left is not freed inside this one's save (see the 0.235 s 3 GB
stall of the 2026-12-05 run in docs/benchmarks.md)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import stall  # noqa: E402


def _loop(monkeypatch: pytest.MonkeyPatch) -> stall.Loop:
    monkeypatch.setattr(stall, "WIDTH", 64)  # ~100 KB of model + Adam
    model, opt = stall.build(100_000)
    return stall.Loop(model, opt, step_s=0.005)


def test_calls_are_kept_apart_from_the_pre_step_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _loop(monkeypatch)

    class Waits(stall.TgAsync):  # a method whose next optimizer step waits 1 s of fake time after each save
        pending = False

        def save(self, path: Path) -> float:
            self.pending = True
            return super().save(path)

        def before_step(self) -> float:
            waited, self.pending = (1.0 if self.pending else 0.0), False
            return waited

    out = stall.run_method(Waits(loop.model, loop.opt), loop, steps=6, every=2, tmp=tmp_path)
    assert out["saves"] == 2 and len(out["calls_s"]) == 2
    for call, total in zip(out["calls_s"], out["stalls_s"], strict=True):
        assert 0 < call < 1.0 and total == pytest.approx(call + 1.0, abs=0.5)  # + trainguard's own hook wait
    combined = stall._combine([out, out])
    assert combined["calls_s"] == out["calls_s"] * 2
    assert not any(tmp_path.iterdir()), "checkpoints left behind"


def test_each_method_runs_after_a_full_collection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _loop(monkeypatch)
    collected: list[int] = []

    def probe(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            collected.append(info["collected"])

    class Cycle:  # garbage only the cyclic collector frees, as an earlier method may leave
        def __init__(self) -> None:
            self.me, self.data = self, torch.zeros(1000)

    gc.callbacks.append(probe)
    was = gc.isenabled()
    gc.disable()  # nothing but run_method's own collection may free the cycle
    try:
        Cycle()
        stall.run_method(None, loop, steps=2, every=2, tmp=tmp_path)
    finally:
        gc.callbacks.remove(probe)
        if was:
            gc.enable()
    assert collected and max(collected) >= 1, collected


def test_dcp_calls_say_how_long_they_waited_for_the_previous_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save's wait for the previous one is kept, DCP's as trainguard's: a long stall in the call
    is told apart from a previous save still writing (DCP's background-staging calls at 1 GB were
    0.011 s or 0.10-0.12 s on 2026-12-06, with 0-1.5 ms of waiting for the previous save)."""
    loop = _loop(monkeypatch)
    for method in (stall.DcpAsyncBg, stall.TgAsync):
        out = stall.run_method(method(loop.model, loop.opt), loop, steps=6, every=2, tmp=tmp_path)
        waits = out["wait_previous_s"]
        assert len(waits) == 2 and all(0 <= w <= c for w, c in zip(waits, out["calls_s"], strict=True)), (method, out)
