"""DalyInterval counts what an async save costs training beyond its stall: the steps that run
while it is written take longer when the save's copy, checksum and write compete with training
for the CPU (on this 2-core machine, `python -m bench.stall` measured 0.45 s of training lost
per 1 GB save against a 0.011 s stall). Before, the policy's cost was the stall alone, and on
such a machine it saved about sqrt(cost / stall) times too often."""

from __future__ import annotations

import math

import pytest

from trainguard.daly import DalyInterval
from trainguard.events import EventLog, read_events
from trainguard.reliability import daly_interval, format_duration

RATE = {"node_failures_per_day": 0.0065, "nodes": 256}
MTBF = 86400 / (256 * 0.0065)


def drive(policy: DalyInterval, steps: range, *, step_s: float, slow_s: float, stall_s: float,
          write_s: float) -> list[int]:
    """trainguard's async manager, with a fake clock: a save blocks for ``stall_s``, then is
    written for ``write_s`` while the steps take ``slow_s`` instead of ``step_s``; it is reported
    (exact duration, up to its commit) at the next save's decision, as the manager does."""
    policy.exact_durations = True
    saved: list[int] = []
    clock, pending = 0.0, None  # (step, call time, commit time)
    for step in steps:
        clock += slow_s if pending and clock < pending[2] else step_s
        policy.on_step(step, clock)
        if policy.should_save(step, clock):
            if pending:
                policy.on_saved(pending[0], stall_s, pending[2] - pending[1])
            pending = (step, clock, clock + stall_s + write_s)
            clock += stall_s
            saved.append(step)
    return saved


def test_slower_steps_while_a_save_is_written_are_part_of_its_cost() -> None:
    p = DalyInterval(**RATE, initial_steps=50)
    saved = drive(p, range(0, 8000), step_s=0.5, slow_s=0.75, stall_s=0.01, write_s=3.0)
    m = p.measurements()
    # the steps that begin within the 3.01 s after the call: 4 of them, each 0.25 s slower (the
    # first one's sample also holds the call's 0.01 s stall, which is not counted twice)
    assert m["slowdown_s"] == pytest.approx(1.0)
    assert m["stall_s"] == 0.01 and m["step_time_s"] == pytest.approx(0.5)
    expected = round(daly_interval(1.01, MTBF) / 0.5)
    assert p.interval_steps == expected
    assert expected > 8 * round(daly_interval(0.01, MTBF) / 0.5)  # what the stall alone gave
    assert [b - a for a, b in zip(saved[2:-1], saved[3:], strict=True)] == [expected] * (len(saved) - 3)
    f = format_duration
    assert f"save cost {f(m['stall_s'] + m['slowdown_s'])} (stall {f(0.01)} + {f(m['slowdown_s'])} of slower steps)" in p.reason


def test_no_slowdown_when_steps_keep_their_speed() -> None:
    """A GPU job: the save's CPU work does not slow the steps; the interval is the stall's."""
    p = DalyInterval(**RATE, initial_steps=50)
    drive(p, range(0, 4000), step_s=0.5, slow_s=0.5, stall_s=0.01, write_s=3.0)
    assert p.measurements()["slowdown_s"] == 0.0
    assert p.interval_steps == round(daly_interval(0.01, MTBF) / 0.5)
    assert p.reason.startswith(f"Daly: stall {format_duration(0.01)},")


def test_forced_save_and_sync_save_have_no_slowdown() -> None:
    p = DalyInterval(**RATE, initial_steps=5)
    for step in range(0, 5):
        p.on_step(step, step * 0.5)
    p.on_saved(4, 0.2, 0.2)  # forced: not decided by the policy
    assert p.measurements()["slowdown_s"] == 0.0
    n = p.next_step
    for step in range(5, n + 1):
        p.on_step(step, 3.0 + (step - 5) * 0.5)
    assert p.should_save(n, 3.0 + (n - 5) * 0.5)
    p.on_saved(n, 0.3, 0.3)  # sync: reported in the same mgr.save, before the next step
    for step in range(n + 1, n + 4):
        p.on_step(step, 3.3 + (step - 5) * 2.0)  # slow steps after it: not the sync save's doing
    assert p.measurements()["slowdown_s"] == 0.0


def test_ranks_agree_on_the_cost_and_the_event_says_it(tmp_path) -> None:
    p = DalyInterval(**RATE, initial_steps=50)
    p.events = EventLog(tmp_path / "events.jsonl")
    drive(p, range(0, 400), step_s=0.5, slow_s=1.0, stall_s=0.01, write_s=1.5)
    ev = [e for e in read_events(tmp_path) if e.get("rule") == "daly"][-1]
    assert ev["slowdown_s"] == pytest.approx(1.0) and ev["stall_s"] == 0.01  # 2 steps, 0.5 s slower each
    q = DalyInterval(**RATE, initial_steps=50)
    q.agree(100, p.measurements())  # another rank, from rank 0's values
    assert q.interval_steps == p.interval_steps == round(daly_interval(1.01, MTBF) / 0.5)
    old = {k: v for k, v in p.measurements().items() if k != "slowdown_s"}  # a caller without the new key
    q.agree(100, old)
    assert q.interval_steps == round(daly_interval(0.01, MTBF) / 0.5)


def test_real_manager_measures_the_slowdown_of_async_saves(tmp_path, monkeypatch) -> None:
    """trainguard's manager with real async saves of a small model on test_plan17_review's
    virtual clock (a save blocks 2 s, is written for 300 s): the steps take 1.5 s instead of
    1.0 s while a write runs, 0.5 s more each. The second save, decided while the first was still
    being written, waits for it (285 s): that wait is neither its stall nor its slowdown."""
    import torch

    import trainguard as tg
    from test_plan17_review import STALL_S, WRITE_S, _virtual_clock

    vt = _virtual_clock(monkeypatch)
    policy = tg.DalyInterval(node_mtbf_s=625.0, nodes=1, initial_steps=10)
    state = {"model": torch.nn.Linear(4, 4)}
    commit = -1.0
    with tg.CheckpointManager(tmp_path / "ck", save=policy, keep=tg.KeepLatest(2), async_save=True) as mgr:
        for step in range(0, 2000):
            vt[0] += 1.5 if vt[0] < commit else 1.0
            if mgr.save(step, state) is not None:
                commit = vt[0] + WRITE_S  # after the call's stall (and any wait for the previous save)
    m = policy.measurements()
    evs = [e for e in read_events(tmp_path / "ck") if e["event"] == "interval" and "slowdown_s" in e]
    # the first save's 10 slow steps seen (it was written on while the second waited), then 200 a save: the
    # first save's measurement sets the interval alone and is dropped at the second (the median of the two,
    # 52.5, before session 56: tests/test_hunt56_review56f.py)
    assert [e["slowdown_s"] for e in evs[:3]] == [pytest.approx(5.0), pytest.approx(100.0), pytest.approx(100.0)]
    assert m["slowdown_s"] == pytest.approx(100.0) and m["stall_s"] == STALL_S and m["step_time_s"] == 1.0
    floor = math.ceil((STALL_S + WRITE_S) / 1.0)
    assert floor > round(daly_interval(STALL_S + 100.0, 625.0))  # still the binding rule
    assert policy.interval_steps == floor
    assert evs[-1]["slowdown_s"] == pytest.approx(100.0) and "of slower steps" in evs[-1]["reason"]


def test_a_policy_without_waited_s_or_without_a_signature_still_gets_its_three_arguments(tmp_path) -> None:
    """The manager passes ``waited_s`` only to an ``on_saved`` that takes it (a policy of the
    user's written for the three arguments keeps working), and none to one whose signature
    cannot be read."""
    import torch

    import trainguard as tg

    got: list[tuple] = []

    class Three(tg.EveryNSteps):
        def on_saved(self, step, stall, duration):
            got.append((step, "three"))

    class NoSignature(tg.EveryNSteps):
        on_saved = property(lambda self: _CallableWithoutSignature(got))

    for policy in (Three(1), NoSignature(1)):
        with tg.CheckpointManager(tmp_path / type(policy).__name__, save=policy, async_save=True) as mgr:
            for step in (1, 2):
                mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    assert got == [(1, "three"), (2, "three"), (1, "nosig"), (2, "nosig")]


class _CallableWithoutSignature:
    __signature__ = "not a signature"  # inspect.signature raises TypeError on it

    def __init__(self, got: list[tuple]) -> None:
        self.got = got

    def __call__(self, step, stall, duration, **kw):
        assert not kw, kw
        self.got.append((step, "nosig"))
