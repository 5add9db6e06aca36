"""Async saves and tensors of the state changed in place outside ``optimizer.step()`` right
after the call (a review): such a change before the save has copied the tensor bumps its
version counter, and the handle warns and names it (``SaveHandle.modified_while_staging``);
steps that wait for the copies (an optimizer of the state, one over the same parameters,
``GradScaler.step``, an LBFGS closure step) and changes after ``wait_staged()`` are not warned.
The background copies are held by the ``gate`` fixture, so every change lands before them."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import async_save, stage


@pytest.fixture(autouse=True)
def _own_async_state(monkeypatch):
    monkeypatch.setattr(stage, "_DEFAULT", {})
    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "0")
    yield
    job = async_save._INFLIGHT
    if job is not None and job.handle._thread is not None and job.handle._thread.ident is not None:
        job.handle.join()


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 32)).sum().backward()
    optim.step()
    return model, optim


def _ema(model, optim) -> None:
    with torch.no_grad():
        ps = list(model.parameters())
        torch._foreach_lerp_(ps, [torch.zeros_like(p) for p in ps], 0.5)


def _clamp(model, optim) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.01, 0.01)


def _load_state_dict(model, optim) -> None:
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})


def _reset_moments(model, optim) -> None:
    for s in optim.state.values():
        s["exp_avg"].zero_()


@pytest.mark.parametrize("change,changed", [
    (_ema, "model/0.weight"), (_clamp, "model/2.bias"), (_load_state_dict, "model/0.bias"),
    (_reset_moments, "optim/state/0.weight/exp_avg"),
])
def test_a_tensor_changed_in_place_outside_step_before_it_was_copied_is_warned_by_name(tmp_path, gate, caplog, change, changed):
    model, optim = _trained()
    h = tg.save(tmp_path / "c", {"model": model, "optim": optim}, async_=True)
    change(model, optim)  # no wait_staged(): the background copies (held) have not run yet
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        gate.set()
        h.result(timeout=60)
    assert changed in h.modified_while_staging
    assert any("changed in place" in r.getMessage() and "wait_staged()" in r.getMessage() for r in caplog.records)


def test_steps_that_wait_for_the_copies_and_changes_after_wait_staged_are_not_warned(tmp_path, gate, caplog):
    model, optim = _trained()
    at_call = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu")
    side = torch.optim.SGD(model.parameters(), lr=1.0)  # not in the state, over the same parameters

    def train() -> None:
        model(torch.randn(8, 32) * 3 + 1).sum().backward()  # BatchNorm stats change: copied in the call
        side.step()
        optim.zero_grad()
        scaler.scale(model(torch.randn(8, 32)).sum()).backward()
        scaler.step(optim)  # GradScaler.step runs optim.step(): the pre-step hook fires
        scaler.update()

    with caplog.at_level(logging.WARNING, logger="trainguard"):
        h = tg.save(tmp_path / "c", {"model": model, "optim": optim}, async_=True)
        t = threading.Thread(target=train, name="test-training-step")
        t.start()
        try:
            assert h.waiting.wait(20), "a step did not wait for the save's copies"
            assert all(torch.equal(v, at_call[k]) for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k)
        finally:
            gate.set()
            t.join(60)
        assert not t.is_alive()
        assert h.wait_staged(60)
        _ema(model, optim)  # after wait_staged(): allowed
        h.result(timeout=60)
    assert h.modified_while_staging == []
    assert not [r for r in caplog.records if "changed in place" in r.getMessage()]
    got = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    tg.load(tmp_path / "c", {"model": got}, only=["model"])
    assert all(torch.equal(v, at_call[k]) for k, v in got.state_dict().items())


def test_an_lbfgs_closure_step_waits_for_the_copies_and_is_not_warned(tmp_path, gate):
    torch.manual_seed(0)
    model = nn.Linear(32, 4)
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x = torch.randn(8, 32)

    def closure():
        optim.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    optim.step(closure)
    at_call = model.weight.detach().clone()
    h = tg.save(tmp_path / "c", {"model": model, "optim": optim}, async_=True)
    t = threading.Thread(target=optim.step, args=(closure,), name="test-lbfgs-step")
    t.start()
    try:
        assert h.waiting.wait(20), "LBFGS.step(closure) did not wait for the save's copies"
        assert torch.equal(model.weight, at_call)
    finally:
        gate.set()
        t.join(60)
    h.result(timeout=60)
    assert h.modified_while_staging == []
    got = nn.Linear(32, 4)
    tg.load(tmp_path / "c", {"model": got}, only=["model"])
    assert torch.equal(got.weight, at_call)


def test_the_manager_logs_a_modified_while_staging_event_for_such_a_save(tmp_path, gate):
    import json

    model, optim = _trained()
    with tg.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        h = mgr.save(1, {"model": model, "optim": optim}, force=True)
        _ema(model, optim)
        gate.set()
    assert "model/0.weight" in h.modified_while_staging
    with open(tmp_path / "run" / "events.jsonl") as f:
        found = [e for e in map(json.loads, f) if e.get("event") == "modified_while_staging"]
    assert len(found) == 1 and found[0]["step"] == 1 and "model/0.weight" in found[0]["tensors"]
