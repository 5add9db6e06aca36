"""Review of the code added in the last hours (rollback set-aside, sampler, report, retention facts,
imports): each test failed before its fix."""

from __future__ import annotations

import warnings

import torch

import trainguard as tg
from test_rollback_crash import _first_run, _resume, _rollback_and_fail, _steps


def test_a_second_rollback_after_a_failed_first_save_keeps_the_abandoned_steps_aside(tmp_path, monkeypatch):
    """restore(step=2), save(3) fails (steps 3-5 set aside under a token), restore(step=2) again,
    save(3) commits. Before: the second restore dropped the token, so that commit did not carry it,
    steps 4 and 5 stayed aside, and the next open put them back: the restart resumed from step 5,
    the timeline rolled back from twice."""
    root = tmp_path / "run"
    _first_run(root)
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), async_save=False, on_error="warn") as mgr:
        _rollback_and_fail(mgr, state, monkeypatch)
        assert mgr.restore(state, step=2) == 2
        state["w"].fill_(30.0)
        mgr.save(3, state)
        assert _steps(root) == ["step-000000001", "step-000000002", "step-000000003"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no debris to clean either
        assert _resume(root) == (3, 30.0)
    assert _steps(root) == ["step-000000001", "step-000000002", "step-000000003"]


class _EMA(torch.nn.Module):
    """A wrapper whose only child is named ``module`` (timm's ModelEmaV2, AveragedModel-like)."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.module = m


def test_a_torch_file_of_a_model_whose_child_is_named_module_still_loads_after_convert(tmp_path):
    """convert drops a 'module.' prefix every key has (a DDP model's state_dict, 2ad085b). Before:
    the state_dict of a model whose child is named 'module' (torch.save(ema.state_dict())),
    which loaded before that change, then no longer loaded into that model: StateMismatchError
    'missing model/module.weight, unexpected model/weight'."""
    from trainguard.convert import convert

    torch.manual_seed(0)
    src = _EMA(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)))
    src.module[1].running_mean.fill_(0.5)
    torch.save(src.state_dict(), tmp_path / "ema.pt")
    convert(tmp_path / "ema.pt", tmp_path / "ck")
    dst = _EMA(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)))
    tg.load(tmp_path / "ck", {"model": dst})
    got = dst.state_dict()
    assert list(got) == list(src.state_dict())
    assert all(torch.equal(got[k], v) for k, v in src.state_dict().items())
    # the DDP case the prefix removal is for still loads into the plain model
    plain = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    tg.load(tmp_path / "ck", {"model": plain})
    assert torch.equal(plain[0].weight, src.module[0].weight)
