"""Review of today's new code (newcode15): collective rounds numbered per operation
(``dist.StoreDistContext.operation``, ``distwait.py``).

A rank that raised out of a call *before its first round* (a Ctrl-C caught by the script while
the state was captured, while a manager's save waited for the previous async save, or in
restore's wait) was not numbered in that call: its next call joined the rounds of the call the
other ranks were still in, and the ranks' calls stayed one apart for the rest of the run (every
save failed: "ranks disagree on the step", or rank 1 writing into another save's directory).
"""

from __future__ import annotations

import trainguard as tg
from test_rejoin import ENV, _same, _state

from dist_helper import attempt, run_ranks


def _ctrl_c_in_capture(rank: int, world: int, root: str) -> dict:
    import trainguard.api as api

    out: dict = {}
    if rank == 1:
        real = api.capture

        def ctrl_c(*a, **k):  # noqa: ANN002, ANN003, ANN202 - Ctrl-C while this rank captures, before any round
            api.capture = real
            raise KeyboardInterrupt

        api.capture = ctrl_c
        try:
            tg.save(f"{root}/a", _state(1), timeout=20)
            out["first"] = {"type": None}
        except KeyboardInterrupt:
            out["first"] = {"type": "KeyboardInterrupt"}
    else:
        out["first"] = attempt(lambda: tg.save(f"{root}/a", _state(1), timeout=20))
    out["second"] = attempt(lambda: tg.save(f"{root}/b", _state(2), timeout=20))
    out["third"] = attempt(lambda: tg.save(f"{root}/c", _state(3), timeout=20))
    out["loads"] = attempt(lambda: _same(root, "c", 3) or 1 / 0)
    return out


def test_a_ctrl_c_caught_before_a_ranks_first_round_does_not_pair_its_next_save_with_the_others_previous(tmp_path):
    res = run_ranks(_ctrl_c_in_capture, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["first"] == {"type": "KeyboardInterrupt"}, vals
    assert vals[0]["first"]["type"] == "RankFailureError" and vals[0]["first"]["ranks"] == [1], vals
    assert [v["third"] for v in vals] == [{"type": None}] * 2, vals
    assert [v["second"] for v in vals] == [{"type": None}] * 2, vals
    assert [v["loads"] for v in vals] == [{"type": None}] * 2, vals


def _once(obj, name: str):  # noqa: ANN001, ANN202
    """Make ``obj.name`` raise KeyboardInterrupt at its next call (only that one)."""
    real = getattr(obj, name)

    def ctrl_c(*a, **k):  # noqa: ANN002, ANN003, ANN202
        setattr(obj, name, real)
        raise KeyboardInterrupt

    setattr(obj, name, ctrl_c)


def _caught(fn) -> dict:  # noqa: ANN001
    try:
        return attempt(fn)
    except KeyboardInterrupt:
        return {"type": "KeyboardInterrupt"}


def _saves_after_ctrl_c(mgr, rank: int, root: str, inject, again_kw: dict) -> dict:  # noqa: ANN001
    """Save step 1 on every rank, then ``inject()`` a Ctrl-C on rank 1 inside its save of step 2
    (caught), then save steps 3 and 4, close, and restore with a new manager (``again_kw``)."""
    out = {"1": attempt(lambda: mgr.save(1, _state(1)))}
    if rank == 1:
        inject()
    out["2"] = _caught(lambda: mgr.save(2, _state(2)))
    out["3"] = attempt(lambda: mgr.save(3, _state(3)))
    out["4"] = attempt(lambda: mgr.save(4, _state(4)))
    out["close"] = attempt(mgr.close)
    with tg.CheckpointManager(root, timeout=20, **again_kw) as again:
        out["restored"] = attempt(lambda: again.restore(_state(99)))
        out["step"] = again.last_saved_step
    return out


def _managed_async(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # on_error="warn": a failed save is a warning, the next one is made
    mgr = tg.CheckpointManager(
        root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False, timeout=20, on_error="warn"
    ).open()
    # Ctrl-C while rank 1's save of step 2 waits for the save of step 1 (before any round of step 2)
    return _saves_after_ctrl_c(mgr, rank, root, lambda: _once(mgr, "_finish_pending"), {"handle_signals": False})

def test_a_ctrl_c_in_one_ranks_wait_for_the_previous_async_save_does_not_shift_the_later_saves(tmp_path):
    res = run_ranks(_managed_async, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["2"] == {"type": "KeyboardInterrupt"}, vals
    # Step 2 fails on rank 0 (reported at its next call) or is never saved; steps 3 and 4 save on both.
    assert [(v["4"], v["close"]) for v in vals] == [({"type": None}, {"type": None})] * 2, vals
    assert [v["step"] for v in vals] == [4, 4], vals
    assert (tmp_path / "step-000000004").is_dir() and (tmp_path / "step-000000003").is_dir()


def _restore_twice(rank: int, world: int, root: str) -> dict:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20) as mgr:
        mgr.save(1, _state(1))
    mgr = tg.CheckpointManager(root, handle_signals=False, timeout=20).open()
    if rank == 1:  # Ctrl-C in restore's wait for a save in flight, before its first round
        _once(mgr, "wait")
    out = {"first": _caught(lambda: mgr.restore(_state(99)))}
    st = _state(99)
    out["second"] = attempt(lambda: mgr.restore(st))
    out["step"] = st["progress"]["step"]
    out["close"] = attempt(mgr.close)
    return out


def test_a_ctrl_c_before_one_ranks_first_restore_round_fails_the_others_restore_and_the_next_one_pairs(tmp_path):
    res = run_ranks(_restore_twice, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["first"] == {"type": "KeyboardInterrupt"}, vals
    assert vals[0]["first"]["type"] == "RankFailureError" and vals[0]["first"]["ranks"] == [1], vals
    assert "left this trainguard call" in vals[0]["first"]["msg"], vals
    assert [(v["second"], v["step"], v["close"]) for v in vals] == [({"type": None}, 1, {"type": None})] * 2, vals


def _ctrl_c_before_decide(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=20, on_error="warn").open()  # handle_signals: "decide" each step
    # Ctrl-C in rank 1's policy, before step 2's "decide" round
    return _saves_after_ctrl_c(mgr, rank, root, lambda: _once(mgr.save_policy, "should_save"), {})

def test_a_ctrl_c_before_one_ranks_decide_round_does_not_shift_the_later_saves(tmp_path):
    # Before: rank 0's decision (a broadcast) went on without rank 1, whose next save then met
    # rank 0's save of the step before: every later save failed, and the next manager's open too.
    res = run_ranks(_ctrl_c_before_decide, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["2"] == {"type": "KeyboardInterrupt"}, vals
    assert [(v["3"], v["4"], v["close"], v["restored"], v["step"]) for v in vals] == [
        ({"type": None}, {"type": None}, {"type": None}, {"type": None}, 4)
    ] * 2, vals
    assert (tmp_path / "step-000000003").is_dir()


def _names_per_rank(rank: int, world: int, root: str) -> dict:
    return {
        "save": attempt(lambda: tg.save(f"{root}/ckpt-{rank}", _state(1), timeout=20)),  # e.g. a name from each rank's clock
        "next": attempt(lambda: tg.save(f"{root}/same", _state(2), timeout=20)),
    }


def test_ranks_saving_under_different_names_are_told_so_and_leave_nothing(tmp_path):
    # Before: rank 1 wrote into ckpt-1.tmp-<id> (left behind), rank 0 looked in ckpt-0.tmp-<id>, and
    # both were told the run directory must be on shared storage.
    res = run_ranks(_names_per_rank, 2, str(tmp_path), timeout=60, env=ENV)
    for r in res:
        assert r.value["save"]["type"] == "RankFailureError" and r.value["save"]["ranks"] == [1], r.value
        assert "disagree on the name" in r.value["save"]["msg"] and "shared" not in r.value["save"]["msg"], r.value
        assert r.value["next"] == {"type": None}, r.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]


def _skipped_async_then_wait(rank: int, world: int, root: str) -> dict:
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, timeout=20).open()  # "decide" each step
    out = {"1": attempt(lambda: (mgr.save(1, _state(1)), mgr.wait()))}
    if rank == 1:  # Ctrl-C while its save of step 2 waits for the previous save: it never starts step 2's save
        _once(mgr, "_finish_pending")
    out["2"] = _caught(lambda: mgr.save(2, _state(2)))
    out["wait"] = attempt(mgr.wait)  # every rank; rank 1 then goes on to step 3 (its "decide" waits for rank 0)
    out["3"] = attempt(lambda: (mgr.save(3, _state(3)), mgr.wait()))
    out["close"] = attempt(mgr.close)
    return out


def test_a_rank_that_never_started_an_async_save_fails_it_at_once_not_at_the_timeout(tmp_path):
    # Before: rank 0's save thread waited in "begin" for rank 1 while rank 1 waited in step 3's
    # "decide" for rank 0 (inside wait()): 'did not arrive within 20 s' (600 s by default).
    res = run_ranks(_skipped_async_then_wait, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["2"] == {"type": "KeyboardInterrupt"}, vals
    w = vals[0]["wait"]
    assert w["type"] == "RankFailureError" and w["ranks"] == [1] and "left this trainguard call" in w["msg"], vals
    assert [(v["3"], v["close"]) for v in vals] == [({"type": None}, {"type": None})] * 2, vals
    assert (tmp_path / "step-000000003").is_dir() and not (tmp_path / "step-000000002").exists()
