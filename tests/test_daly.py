"""DalyInterval: measures stall and step time, adapts the interval, agrees across ranks, logs why."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainguard.daly import DalyInterval
from trainguard.events import EventLog, read_events
from trainguard.policies import SavePolicy
from trainguard.reliability import daly_interval

RATE = {"node_failures_per_day": 0.0065, "nodes": 256}
MTBF = 86400 / (256 * 0.0065)


def drive(policy: SavePolicy, steps: range, *, step_s: float, stall_s: float, duration_s: float,
          clock: float = 0.0) -> list[int]:
    """The manager's calling order, with a fake clock: each step takes step_s, each save stalls stall_s."""
    saved = []
    for step in steps:
        clock += step_s
        policy.on_step(step, clock)
        if policy.should_save(step, clock):
            clock += stall_s
            policy.on_saved(step, stall_s, duration_s)
            saved.append(step)
    return saved


def drive_async(policy: SavePolicy, steps: range, *, step_s: float, stall_s: float, write_s: float,
                lazy: bool) -> list[int]:
    """An async manager: a save blocks for stall_s, then writes for write_s in the background.

    ``lazy``: completion is noticed only when the next save starts (on_saved then reports the
    whole gap as the duration); otherwise it is polled at every step.
    """
    saved: list[int] = []
    clock, pending = 0.0, None  # pending: (step, start, stall)
    for step in steps:
        clock += step_s
        policy.on_step(step, clock)
        if pending and not lazy and clock >= pending[1] + pending[2] + write_s:
            policy.on_saved(pending[0], pending[2], clock - pending[1])
            pending = None
        if policy.should_save(step, clock):
            start, stall = clock, stall_s
            if pending:  # one save in flight: waiting for it counts as this save's stall
                wait = max(0.0, pending[1] + pending[2] + write_s - clock)
                clock += wait
                stall += wait
                policy.on_saved(pending[0], pending[2], clock - pending[1])
            clock += stall_s
            pending = (step, start, stall)
            saved.append(step)
    return saved


def test_async_saves_with_late_on_saved_do_not_storm_or_ratchet() -> None:
    expected = round(daly_interval(3.0, MTBF) / 0.5)
    for lazy in (True, False):
        p = DalyInterval(**RATE, initial_steps=100)
        saved = drive_async(p, range(0, 6000), step_s=0.5, stall_s=3.0, write_s=30.0, lazy=lazy)
        gaps = [b - a for a, b in zip(saved[:-1], saved[1:], strict=True)]
        assert saved[0] == 100
        # lazy: the save at 200 was decided before the one at 100 was measured
        assert gaps[:1] == ([100] if lazy else [expected]) and set(gaps[1:]) == {expected}, (lazy, gaps)
        assert p.interval_steps == expected


def test_a_background_write_longer_than_daly_sets_the_floor() -> None:
    p = DalyInterval(**RATE, initial_steps=4000)
    saved = drive_async(p, range(0, 14000), step_s=0.5, stall_s=3.0, write_s=1500.0, lazy=False)
    floor = math.ceil((3.0 + 1500.0) / 0.5)  # one save, stall + write, in steps
    assert floor > round(daly_interval(3.0, MTBF) / 0.5)
    assert p.interval_steps == floor and "one save takes" in p.reason
    assert [b - a for a, b in zip(saved[:-1], saved[1:], strict=True)] == [floor] * (len(saved) - 1)
    assert p.measurements()["stall_s"] == 3.0  # never waited for a previous save


def test_should_save_is_stable_within_a_step() -> None:
    p = DalyInterval(**RATE, initial_steps=10)
    p.on_step(0, 0.0)
    assert [p.should_save(s, 0.0) for s in (9, 10, 10, 11, 19, 20)] == [False, True, True, False, False, True]


def test_is_a_save_policy_and_validates() -> None:
    assert isinstance(DalyInterval(**RATE), SavePolicy)
    assert DalyInterval(node_mtbf_s=400 * 86400, nodes=4).mtbf_s == pytest.approx(100 * 86400)
    with pytest.raises(ValueError, match="exactly one"):
        DalyInterval(nodes=4)
    with pytest.raises(ValueError, match="initial_steps"):
        DalyInterval(**RATE, initial_steps=0)
    with pytest.raises(ValueError, match="max_steps"):
        DalyInterval(**RATE, min_steps=10, max_steps=5)


def test_initial_interval_is_anchored_at_the_first_step_seen() -> None:
    fresh = DalyInterval(**RATE, initial_steps=50)
    assert [s for s in range(0, 120) if fresh.should_save(s, 0.0)][:1] == [50]
    resumed = DalyInterval(**RATE, initial_steps=50)  # a resumed run starts at step 5001
    resumed.on_step(5001, 0.0)
    assert not resumed.should_save(5001, 0.0) and resumed.should_save(5051, 0.0)


def test_adapts_to_daly_interval_from_measured_stall_and_step_time() -> None:
    p = DalyInterval(**RATE, initial_steps=100)
    saved = drive(p, range(0, 3000), step_s=0.5, stall_s=3.0, duration_s=20.0)
    expected = round(daly_interval(3.0, MTBF) / 0.5)  # 1112 steps
    assert p.interval_steps == expected
    assert saved == [100, 100 + expected, 100 + 2 * expected]
    m = p.measurements()
    assert m["step_time_s"] == pytest.approx(0.5)
    assert m["stall_s"] == 3.0
    # a 4x slower save moves the optimum by about sqrt(4) = 2x
    q = DalyInterval(**RATE, initial_steps=100)
    drive(q, range(0, 200), step_s=0.5, stall_s=12.0, duration_s=20.0)
    assert q.interval_steps / p.interval_steps == pytest.approx(2.0, rel=0.01)


def test_the_step_spanning_a_save_is_not_a_step_time_sample() -> None:
    p = DalyInterval(**RATE)
    p.on_step(0, 0.0)
    p.on_step(1, 0.5)
    p.on_saved(1, 100.0, 100.0)
    p.on_step(2, 101.0)  # 0.5 s of training + 100 s of stall
    assert p.measurements()["step_time_s"] == 0.5
    p.on_step(4, 102.0)  # sampling resumes after the save
    assert list(p._step_times) == [0.5, 0.5]


def test_never_shorter_than_one_full_save() -> None:
    p = DalyInterval(**RATE, initial_steps=10)
    drive(p, range(0, 20), step_s=1.0, stall_s=1.0, duration_s=5000.0)  # async: short stall, long write
    assert daly_interval(1.0, MTBF) < 5000
    assert p.interval_steps == 5000 and "one save takes" in p.reason


def test_min_and_max_steps_clamp() -> None:
    hi = DalyInterval(**RATE, initial_steps=10, max_steps=300)
    drive(hi, range(0, 20), step_s=0.5, stall_s=3.0, duration_s=3.0)
    assert hi.interval_steps == 300
    lo = DalyInterval(**RATE, initial_steps=10, min_steps=5000)
    assert lo.interval_steps == 5000
    capped = DalyInterval(**RATE, initial_steps=10, max_steps=300)  # the save's duration beats max_steps
    drive(capped, range(0, 20), step_s=0.5, stall_s=3.0, duration_s=400.0)
    assert capped.interval_steps == 800 and "max_steps=300" in capped.reason and "one save takes" in capped.reason
    drive(lo, range(0, 6000), step_s=0.5, stall_s=3.0, duration_s=3.0)
    assert lo.interval_steps == 5000
    capped = DalyInterval(**RATE, initial_steps=10, max_steps=300)  # the save's duration beats max_steps
    drive(capped, range(0, 20), step_s=0.5, stall_s=3.0, duration_s=400.0)
    assert capped.interval_steps == 800 and "max_steps=300" in capped.reason and "one save takes" in capped.reason


def test_waits_when_no_step_time_was_measured() -> None:
    p = DalyInterval(**RATE, initial_steps=1)
    p.on_step(0, 0.0)
    p.on_saved(1, 3.0, 3.0)  # a save before any step-time sample
    assert p.interval_steps == 1 and p.next_step == 2 and "waiting" in p.reason


def test_ranks_agree_on_rank_zeros_measurements() -> None:
    """Two ranks with different local timings decide identically once rank 0's values are agreed."""
    r0, r1 = DalyInterval(**RATE, initial_steps=20), DalyInterval(**RATE, initial_steps=20)
    decisions0, decisions1 = [], []
    for step in range(0, 5000):
        for pol, step_s, out in ((r0, 0.5, decisions0), (r1, 0.53, decisions1)):
            pol.on_step(step, step * step_s)
            out.append(pol.should_save(step, step * step_s))
        if decisions0[-1]:
            assert decisions1[-1]
            r0.on_saved(step, 3.0, 10.0)
            r1.on_saved(step, 3.4, 11.0)
            values = r0.measurements()  # what the manager broadcasts from rank 0
            r1.agree(step, values)
            r0.agree(step, values)
    assert decisions0 == decisions1 and sum(decisions0) >= 3
    assert r0.interval_steps == r1.interval_steps == round(daly_interval(3.0, MTBF) / 0.5)
    # without agreement, the local measurements alone would have diverged
    lone = DalyInterval(**RATE, initial_steps=20)
    drive(lone, range(0, 100), step_s=0.53, stall_s=3.4, duration_s=11.0)
    assert lone.interval_steps != r0.interval_steps


def test_interval_choices_are_in_the_event_log(tmp_path: Path) -> None:
    p = DalyInterval(**RATE, initial_steps=100)
    p.events = EventLog(tmp_path / "events.jsonl")
    drive(p, range(0, 1500), step_s=0.5, stall_s=3.0, duration_s=20.0)
    evs = [e for e in read_events(tmp_path) if e["event"] == "interval"]
    assert [e["rule"] for e in evs] == ["initial", "daly", "daly"]
    assert evs[0]["steps"] == 100 and evs[0]["next_step"] == 100
    assert evs[1]["steps"] == p.interval_steps and evs[1]["next_step"] == 100 + p.interval_steps
    assert evs[1]["stall_s"] == 3.0 and evs[1]["step_time_s"] == pytest.approx(0.5)
    assert "Daly" in evs[1]["reason"] and f"{p.interval_steps} steps" in evs[1]["reason"]
    assert math.isclose(evs[1]["mtbf_s"], MTBF)


def test_no_event_log_is_fine_and_describe_says_why() -> None:
    p = DalyInterval(**RATE)
    p.events = None
    drive(p, range(0, 200), step_s=0.5, stall_s=3.0, duration_s=3.0)
    assert "Daly" in p.describe() and str(p.interval_steps) in p.describe()
