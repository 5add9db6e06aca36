"""review58h: a hostile look at review58c's retention change (``keptseen.metadata_picks``) and split58's moves.

``metadata_picks`` counted every member of a union that declares ``reads_metadata = False`` as a policy of
steps alone whose kept steps need no look (the built-in ``KeepLatest``/``KeepEvery``/``KeepAll`` are such). A
policy of the user's that declares it may still keep a step because of the others listed (the oldest one,
say): one of its kept steps gone or damaged, the step that takes its place may be the one retention deletes.
"""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard import layout
from trainguard.policies import RetentionPolicy


class KeepFirst(RetentionPolicy):
    """The oldest committed checkpoint (a user's policy of steps alone: the run's starting point)."""

    reads_metadata = False

    def select(self, checkpoints):
        return {min(c.step for c in checkpoints)} if checkpoints else set()


def _state(step: int) -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 2), "p": tg.StateDict(step=step)}


@pytest.mark.parametrize("order", ["first_last", "first_first"])
def test_a_users_step_policy_in_a_union_with_keepbest_still_gets_its_gone_step_replaced(tmp_path, order):
    """KeepLatest(2) | KeepBest("loss") | KeepFirst(): step 1's manifest removed by hand after the save of step 3.
    Before, the save of step 4 looked only at KeepBest's picks and the steps newer than the one it deleted, trusted
    step 1 as the first, and deleted step 2, the oldest valid one: what KeepFirst keeps was gone for good."""
    if order == "first_last":
        keep = tg.KeepLatest(2) | tg.KeepBest("loss") | KeepFirst()
    else:  # a union of step policies inside the union: KeepUnion(KeepUnion(KeepFirst, KeepLatest), KeepBest)
        keep = KeepFirst() | tg.KeepLatest(2) | tg.KeepBest("loss")
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for step, loss in ((1, 9.0), (2, 1.0), (3, 5.0)):
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.wait()
        (root / layout.step_dir(1) / layout.MANIFEST).unlink()  # by hand (or a cleanup job)
        mgr.save(4, _state(4), metrics={"loss": 0.5})
        mgr.wait()
    held = {layout.parse_step(p.name) for p in root.iterdir() if (p / layout.MANIFEST).exists()}
    assert 2 in held, held  # the oldest valid checkpoint, KeepFirst's now
    assert held == {2, 3, 4}, held


def test_built_in_step_policies_nested_in_a_union_still_need_no_look_at_every_kept_step():
    """The fix above counts only a policy of the user's as one whose kept steps all need a look: ``KeepLatest(2) |
    KeepEvery(5) | KeepBest(..)`` (a union of step policies inside the union) still looks at KeepBest's picks only
    (review58c's saving: its stat per kept step grew with the run's length)."""
    from trainguard.keptseen import metadata_picks
    from trainguard.policies import CheckpointInfo

    infos = [CheckpointInfo(step=s, created=0.0, metrics={"loss": float(s % 7)}) for s in range(1, 40)]
    for keep in (tg.KeepLatest(2) | tg.KeepEvery(5) | tg.KeepBest("loss", 2),
                 tg.KeepBest("loss", 2) | (tg.KeepLatest(2) | tg.KeepEvery(5)), tg.KeepBest("loss", 2) | tg.KeepAll()):
        assert metadata_picks(keep, infos) == tg.KeepBest("loss", 2).select(infos), keep
    assert metadata_picks(tg.KeepBest("loss", 2) | KeepFirst(), infos) is None  # a user's: every kept step
