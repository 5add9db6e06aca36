"""Review (leak22): what a ``CheckpointManager`` keeps per save over a long run. Its own steps
(``_own``) grew by one entry a save on every rank, the saves' metrics (``_metrics``) on every rank
but 0 (where retention alone reads them): a week saving every minute, some 10,000 entries each.
Real files; 2 ranks through gloo on 127.0.0.1."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import trainguard as tg

from dist_helper import run_ranks


def _state(v: float) -> dict:
    return {"w": torch.full((8,), float(v))}


def _steps(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and "." not in n)


def _small_window(keep: int) -> None:
    try:  # the module that bounds it (before the fix: absent, the set grows)
        import trainguard.ownsteps as own
    except ImportError:
        return
    own.KEEP = keep


def _many_saves(rank: int, world: int, root: str, n: int) -> dict:
    _small_window(2)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False)
    with mgr:
        assert mgr.restore(_state(0)) is None
        for s in range(1, n + 1):
            mgr.save(s, _state(s), metrics={"loss": 1.0 / s})
    return {"own": [s for s in range(n + 1) if s in mgr._own], "len_own": len(mgr._own), "metrics": sorted(mgr._metrics)}


def test_a_long_run_keeps_a_bounded_record_of_its_saves_on_every_rank(tmp_path):
    n = 14
    out = [r.value for r in run_ranks(_many_saves, 2, str(tmp_path), n, timeout=120)]
    for v in out:  # before: 14 own steps on each rank, and rank 1 14 metrics entries
        assert v["len_own"] <= 4, v
        assert v["own"][-1] == n and v["own"] == list(range(n - len(v["own"]) + 1, n + 1)), v
    assert out[0]["own"] == out[1]["own"]  # the same steps remembered on every rank: the same save decisions
    assert out[0]["metrics"] == [n - 1, n] and out[1]["metrics"] == []  # rank 0: those of the kept checkpoints
    assert _steps(tmp_path) == [n - 1, n]
    with tg.CheckpointManager(tmp_path, handle_signals=False) as mgr:
        state = _state(0)
        assert mgr.restore(state) == n and float(state["w"][0]) == n


def test_after_restore_a_save_behind_the_forgotten_steps_is_refused_and_nothing_is_lost(tmp_path, monkeypatch):
    import trainguard.ownsteps as own

    monkeypatch.setattr(own, "KEEP", 2)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, _state(1))
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        assert mgr.restore(_state(0)) == 1
        for s in range(2, 21, 2):
            mgr.save(s, _state(s))
        assert 5 <= mgr._own.floor < 18  # steps 2..floor are forgotten
        # A loop gone back, far (its own newer steps forgotten) or not: refused (session 31: a restart
        # resumes from the newest, 20, and would skip what the older step holds).
        for behind in (5, 19):
            with pytest.raises(tg.CheckpointError, match=rf"save\(step={behind}\): this manager saved step 20 already"):
                mgr.save(behind, _state(behind))
    assert _steps(tmp_path) == [1, *range(2, 21, 2)]


def test_a_save_behind_forgotten_steps_without_restore_takes_them_for_no_other_runs(tmp_path, monkeypatch, caplog):
    # Regression guard: retention must not call a forgotten step of this run another run's (a
    # warning here; after a restore it would delete it as an abandoned timeline).
    import trainguard.ownsteps as own

    monkeypatch.setattr(own, "KEEP", 2)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(20), handle_signals=False) as mgr:
            for s in range(2, 21, 2):
                mgr.save(s, _state(s))
            assert mgr._own.floor is not None and mgr._own.floor > 3
            with pytest.raises(tg.CheckpointError, match=r"save\(step=3\): this manager saved step 20 already"):
                mgr.save(3, _state(3))  # refused since session 31; it was saved, and retention had to keep 4..20
            mgr.save(21, _state(21))  # retention with steps 2..floor forgotten: none taken for another run's
    assert "did not write" not in caplog.text
    assert _steps(tmp_path) == [*range(2, 21, 2), 21]  # KeepLatest(20): all 11 kept, the forgotten ones too


def _pending_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tg.PendingGradientsWarning)]


def test_watched_optimizers_add_no_hook_to_backward_and_the_warning_still_holds(tmp_path):
    # Before: a Python post-accumulate-grad hook per parameter, called at every backward() (bench/gradwatch_cost.py).
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = {"model": model, "optim": opt}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
            mgr.restore(st)
            assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            mgr.save(1, st)  # after step(), grads still set: not warned
            model(torch.randn(2, 4)).sum().backward()  # accumulates into the used grads (no zero_grad)
            mgr.save(2, st)  # warned
            opt.step()
            opt.zero_grad(set_to_none=False)  # written (zeroed) after the step, but all zero: not warned
            mgr.save(3, st)
    warned = _pending_warnings(caught)
    assert len(warned) == 1 and "save of step 2" in warned[0] and "4 parameter(s)" in warned[0], warned


def test_a_gradient_set_by_hand_after_step_is_warned(tmp_path):
    # Before: p.grad = ... (gradients computed with torch.autograd.grad, compressed, averaged by
    # hand) ran no post-accumulate-grad hook, and a save before the step() that would use them
    # was not warned about.
    import warnings

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = {"model": model, "optim": opt}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
            mgr.restore(st)
            for step in (1, 2):
                loss = model(torch.randn(2, 4)).sum()
                grads = torch.autograd.grad(loss, list(model.parameters()))
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
                if step == 1:
                    opt.step()
                mgr.save(step, st)
    warned = _pending_warnings(caught)
    assert len(warned) == 1 and "save of step 2" in warned[0] and "2 parameter(s)" in warned[0], warned
