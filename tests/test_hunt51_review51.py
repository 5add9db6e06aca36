"""Hostile review (session 51) of the code merged this session: distpack, ptwrite, report."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard import report as rep
from trainguard.cli import main
from trainguard.distpack import pack, unpack
from trainguard.events import read_events


def _wire(values):
    """What a rank other than 0 gets: rank 0's pack, through the store's JSON, unpacked."""
    return unpack(json.loads(json.dumps(pack(values))))


@pytest.mark.parametrize("values", [
    [0.0, -0.0],  # 0.0 == -0.0: were merged into one table entry, rank 1 read 0.0
    [{"loss": 0.0}, {"loss": -0.0}],
    [{1: "a"}, {"1": "b"}],  # two fields whose JSON keys were the same "1": rank 0's value was lost
    [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # rank 1's key order became rank 0's
    [{"b": None}, {"a": None, "b": None}],
])
def test_distpack_round_trips_like_json(values):
    got = _wire(values)
    assert json.dumps(got) == json.dumps(json.loads(json.dumps(values)))


_scalar = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4)
           | st.sampled_from([0.0, -0.0, 1, 1.0, True, "1"]))
_value = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.tuples(c) | st.dictionaries(
    st.sampled_from(["a", "b", "n", "col", "fields", "order"]), c, max_size=3), max_leaves=8)


@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
@given(st.lists(_value | st.dictionaries(st.sampled_from(["a", "b", "c", "order"]) | st.integers(0, 2), _value,
                                         max_size=3), max_size=5))
def test_distpack_property_json_text_equal(values):
    assert json.dumps(_wire(values)) == json.dumps(json.loads(json.dumps(values)))


# -- report: a save counted from its restore -------------------------------------------------------

TRAIN = textwrap.dedent("""
    import sys
    import torch
    import trainguard as tg
    torch.set_num_threads(1)
    root, last = sys.argv[1], int(sys.argv[2])
    state = {"w": torch.zeros(64), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(100)) as mgr:
        step = mgr.restore(state) or 0
        while step < last:
            step += 1
            state["w"].add_(1)
            mgr.save(step, state)
""")


def _no_tg_env(**extra: str) -> dict[str, str | None]:
    """``forked``'s ``env``: the TRAINGUARD_ variables of this process taken out, ``extra`` added."""
    return {**{k: None for k in os.environ if k.startswith("TRAINGUARD_")}, **extra}


def _train(forked, root: Path, last: int) -> None:
    """TRAIN in a process of its own (``conftest.forked``: a fork of a process that imported torch once)."""
    log = root.parent / f"train-{root.name}-{last}.log"
    code = forked(TRAIN, root, last, env=_no_tg_env(), log=log)
    assert code == 0, log.read_text()[-3000:]


def test_a_checkpoint_copied_into_a_new_run_is_no_save_killed_at_its_commit(tmp_path: Path, forked) -> None:
    """A run goes on from a checkpoint copied into a new run directory (its save was logged in the
    other run's log): the new run made 2 saves. The report said 3 saves "(1 with no save event, known
    from its restore: killed at its commit)" and, for the same log written by the code before that
    count, a figure other than the 2 it reported then."""
    a, b = tmp_path / "a", tmp_path / "b"
    _train(forked, a, 3)
    b.mkdir()
    (three,) = [p for p in a.glob("step-*") if p.name.endswith("3")]
    shutil.copytree(three, b / three.name)
    _train(forked, b, 5)
    assert [e["event"] for e in read_events(b) if e["event"] in ("restore", "fresh_start")] == ["restore"]
    s = rep.summary(rep.tally_log(b))
    assert s["saves"] == 2 and s["saves_unlogged"] == 0, s
    res = CliRunner().invoke(main, ["report", str(b)])
    assert res.exit_code == 0 and "2 saves, stall" in res.output, res.output


def test_a_save_killed_at_its_commit_after_a_copied_checkpoint_still_counts(tmp_path: Path, forked) -> None:
    """The same new run, its process SIGKILLed right after the commit of step 4 (no save event): the
    next process restores 4, saves 5. 4 and 5 are this log's saves; the copied 3 is not."""
    a, b = tmp_path / "a", tmp_path / "b"
    _train(forked, a, 3)
    b.mkdir()
    (three,) = [p for p in a.glob("step-*") if p.name.endswith("3")]
    shutil.copytree(three, b / three.name)
    env = _no_tg_env(TRAINGUARD_CRASH_AT="after_rename", TRAINGUARD_CRASH_KIND="kill")
    code = forked(TRAIN, b, 5, env=env, log=tmp_path / "killed.log")
    assert code == -9, (tmp_path / "killed.log").read_text()[-3000:]
    _train(forked, b, 5)
    assert [e["step"] for e in read_events(b) if e["event"] == "restore"] == [3, 4]
    s = rep.summary(rep.tally_log(b))
    assert s["saves"] == 2 and s["saves_unlogged"] == 1, s


def test_a_step_0_save_killed_at_its_commit_after_a_fresh_start_counts() -> None:
    """A fresh start found no checkpoint: one of step 0 restored later was saved by this log's process."""
    ev = [{"t": 1.0, "event": "fresh_start", "rank": 0, "pid": 1},
          {"t": 5.0, "event": "restore", "rank": 0, "pid": 2, "step": 0, "seconds": 0.1},
          {"t": 6.0, "event": "save", "rank": 0, "pid": 2, "step": 1, "stall_s": 0.1, "duration_s": 0.1}]
    s = rep.summarize(ev)
    assert s["saves"] == 2 and s["saves_unlogged"] == 1, s
