"""An async save that committed reaches the save policy at the next ``save()`` call of the loop, not
only when the next save starts: ``DalyInterval``'s first measured interval applied one save late
before (saves at steps 5 and 9 with ``initial_steps=4``, the measurement of step 5 saying 1000)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.events import EVENTS_FILE


def test_a_committed_async_save_sets_the_interval_before_the_next_save_is_decided(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = tg.DalyInterval(node_mtbf_s=3600.0, initial_steps=4, max_steps=1000)
    saved = []
    with tg.CheckpointManager(tmp_path / "run", save=policy, async_save=True, handle_signals=False) as mgr:
        for step in range(1, 30):
            opt.zero_grad()
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            h = mgr.save(step, {"model": model, "optim": opt})
            if h is not None:
                saved.append(step)
                h.result(timeout=60)  # committed before the next step
            if step == 6:  # collected by this call: the policy has its measurement
                assert mgr.last_saved_step == 5
                assert policy.interval_steps > 4
    assert saved == [5]  # before: [5, 9], the second one at initial_steps
    events = [json.loads(x) for x in (tmp_path / "run" / EVENTS_FILE).read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "save"] == [5]


def test_a_failed_async_save_is_still_raised_at_the_next_save_not_at_a_step_between(tmp_path: Path, monkeypatch) -> None:
    from trainguard.storage import local

    model = torch.nn.Linear(8, 8)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(3), async_save=True, handle_signals=False) as mgr:
        real = local._LocalWriter.pwrite

        def failing(self, data, offset):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(local._LocalWriter, "pwrite", failing)
        h = mgr.save(3, {"model": model})
        assert h is not None
        h.join(60)  # ended, its error not observed (result() would have taken it)
        assert h.done() and h.exception() is not None
        monkeypatch.setattr(local._LocalWriter, "pwrite", real)
        assert mgr.save(4, {"model": model}) is None  # not collected here: the failure belongs to the next save
        with pytest.raises(tg.CheckpointError, match="Input/output error"):
            mgr.save(6, {"model": model})
