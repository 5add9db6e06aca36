"""Review 56f of save-interval planning: the formulas against the literature, ``trainguard plan``
against them, and ``tg.DalyInterval`` with a first save that pays one-off costs, a sync save
longer than the job MTBF, and a resumed process.

The reference figures here are computed from the papers' formulas, written out again below, not
by calling ``trainguard.reliability``: Young 1974 ``sqrt(2 C M)``; Daly 2006
``sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C`` for ``C < 2M``, else ``M``; failures of ``N``
independent nodes of MTBF ``m``: ``P(t) = 1 - exp(-N t / m)``; the expected wall time of one
interval, ``M e^{R/M} (e^{(tau+C)/M} - 1)`` (Daly 2006), and its exact optimum found by a golden
section search on the efficiency itself (the code bisects the derivative's root).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import manager as manager_mod
from trainguard.cli import main
from trainguard.daly import DalyInterval
from trainguard.events import read_events


def young_ref(c: float, m: float) -> float:
    return (2 * c * m) ** 0.5


def daly_ref(c: float, m: float) -> float:
    if c >= 2 * m:
        return m
    return (2 * c * m) ** 0.5 * (1 + (c / (2 * m)) ** 0.5 / 3 + c / (18 * m)) - c


def eff_ref(tau: float, c: float, r: float, m: float) -> float:
    return tau / (m * math.exp(r / m) * (math.exp((tau + c) / m) - 1))


def opt_ref(c: float, m: float) -> float:
    a, b, g = 1e-9 * m, 3 * m, (5 ** 0.5 - 1) / 2
    for _ in range(200):
        x, y = b - g * (b - a), a + g * (b - a)
        a, b = (a, y) if eff_ref(x, c, 0, m) > eff_ref(y, c, 0, m) else (x, b)
    return (a + b) / 2


@pytest.mark.parametrize("args, n, per_day, c, r, w, step", [
    (["--nodes", "256", "--node-failures-per-day", "0.0065", "--save-stall", "30s", "--restart", "10m",
      "--step-time", "2s", "--every", "500,1000"], 256, 0.0065, 30.0, 600.0, 0.0, 2.0),
    (["--nodes", "64", "--node-mtbf", "50d", "--save-stall", "2m", "--restart", "20m", "--save-duration", "12m",
      "--every", "30m"], 64, 1 / 50, 120.0, 1200.0, 600.0, None),
    (["--node-mtbf", "86.4s", "--save-stall", "3m", "--restart", "0"], 1, 1000.0, 180.0, 0.0, 0.0, None),
])
def test_plan_json_agrees_with_the_papers_formulas(args, n, per_day, c, r, w, step) -> None:
    out = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    m = 86400 / (n * per_day)  # N independent nodes: the job fails N times as often
    close = {"rel": 2e-5}
    assert d["job_mtbf_s"] == pytest.approx(m, **close)
    assert d["p_failure_day"] == pytest.approx(1 - math.exp(-n * 86400 / (86400 / per_day)), **close)
    assert d["p_failure_week"] == pytest.approx(1 - math.exp(-7 * 86400 / m), **close)
    assert d["young_interval_s"] == pytest.approx(young_ref(c, m), **close)
    assert d["daly_interval_s"] == pytest.approx(daly_ref(c, m), **close)
    assert d["optimal_interval_s"] == pytest.approx(opt_ref(c, m), rel=1e-4)
    # an async save's commit delay W adds to the restart (a failure before the commit rolls back one more interval)
    assert d["efficiency_at_daly"] == pytest.approx(eff_ref(daly_ref(c, m), c, r + w, m), **close)
    assert d["efficiency_at_optimum"] == pytest.approx(eff_ref(opt_ref(c, m), c, r + w, m), rel=1e-4)
    assert d["lost_gpu_hours_per_day"] == pytest.approx((1 - eff_ref(daly_ref(c, m), c, r + w, m)) * n * 8 * 24, rel=1e-4)
    for row in d["intervals"]:
        assert row["efficiency"] == pytest.approx(eff_ref(row["interval_s"], c, r + w, m), **close)
    if step:
        assert d["daly_interval_steps"] == round(daly_ref(c, m) / step)
        assert [row["steps"] for row in d["intervals"]] == [500, 1000]


def drive_async(policy: DalyInterval, steps: range, *, step_s: float, stall: list[float], write_s: float) -> list[int]:
    """trainguard's async manager on a fake clock: the k-th save blocks ``stall[k]`` (the last one
    for the rest), commits ``write_s`` later and is reported at the first step after its commit, or
    by the next save, which waits for it (the wait is not the save's cost: ``waited_s``)."""
    policy.exact_durations = True
    saved: list[int] = []
    clock, pending = 0.0, None  # (step, call time, commit time, stall)
    for step in steps:
        clock += step_s
        policy.on_step(step, clock)
        if pending and clock >= pending[2]:
            policy.on_saved(pending[0], pending[3], pending[2] - pending[1])
            pending = None
        if policy.should_save(step, clock):
            if pending:
                waited = max(0.0, pending[2] - clock)
                clock += waited
                policy.on_saved(pending[0], pending[3], pending[2] - pending[1], waited_s=waited)
            s = stall[min(len(saved), len(stall) - 1)]
            pending = (step, clock, clock + s + write_s, s)
            clock += s
            saved.append(step)
    return saved


def test_the_first_saves_one_off_cost_sets_one_interval_not_three() -> None:
    """A process's first async save faults its staging buffer in (``trainguard bench``'s first round:
    0.30 s against 0.07 s, 3.75 s on a loaded machine): here 30 s against 1 s. Before, it stayed in
    the medians: alone it set the next interval (right: nothing else is known), then as half of the
    median of two it set the one after too: 1258 steps where 322 was the optimum."""
    m = 86400 / (256 * 0.0065)
    p = DalyInterval(node_failures_per_day=0.0065, nodes=256, initial_steps=100)
    saved = drive_async(p, range(20000), step_s=1.0, stall=[30.0, 1.0], write_s=20.0)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    warm, cold = round(daly_ref(1.0, m)), round(daly_ref(30.0, m))
    assert warm == 322 and gaps[0] == cold  # after the first save: its cost, the only one measured
    assert set(gaps[1:]) == {warm}, gaps[:5]
    assert p.measurements()["stall_s"] == 1.0


def test_a_sync_save_longer_than_the_job_mtbf_saves_at_dalys_M_not_at_its_stall() -> None:
    """Daly's estimate for ``C >= 2M`` is ``M``; the exact optimum for a 3 min stall and an 86.4 s MTBF
    is 82 s. The floor that keeps one async save in flight raised a sync save's interval to its own
    duration (the stall, 180 steps of 1 s), though a sync save never overlaps the next: 3.3 % of the
    time useful instead of 4.8 %."""
    m, c = 86.4, 180.0
    p = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=10)
    clock = 0.0
    for step in range(1000):
        clock += 1.0
        p.on_step(step, clock)
        if p.should_save(step, clock):
            clock += c
            p.on_saved(step, c, c)  # sync: committed within the call
    assert p.interval_steps == round(daly_ref(c, m)) == 86
    assert "one save takes" not in p.reason
    assert eff_ref(86, c, 0, m) > 1.4 * eff_ref(180, c, 0, m)
    # an async save (committing after its stall) keeps its floor: one save in flight at a time
    q = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=10)
    drive_async(q, range(3000), step_s=1.0, stall=[c], write_s=60.0)
    assert q.interval_steps == c + 60 and "one save takes" in q.reason


def _clock(monkeypatch, stalls: list[float]) -> list[float]:
    """The manager's training clock, virtual: each step adds 1 s (the test), the k-th save's
    call blocks ``stalls[k]`` (the last one for the rest). Sync saves, so a save's duration is the
    call's stall (the handle's clock is not read: ``finished_at`` is set by the save's own
    monotonic, so the manager's duration is clamped to the stall by on_saved)."""
    vt, n = [0.0], [0]
    real_start = manager_mod.start_save

    def start_save(*a, **k):
        vt[0] += stalls[min(n[0], len(stalls) - 1)]
        n[0] += 1
        h = real_start(*a, **k)
        h.finished_at = vt[0]
        return h

    monkeypatch.setattr(manager_mod, "time", type("T", (), {"monotonic": staticmethod(lambda: vt[0])}))
    monkeypatch.setattr(manager_mod, "start_save", start_save)
    return vt


def test_a_resumed_process_takes_the_save_costs_its_run_measured_before(tmp_path, monkeypatch) -> None:
    """A new process of the same run (a restart after a failure) forgot every measurement: it saved
    ``initial_steps`` after its first step and then set the interval from that first save alone,
    whose one-off costs (here a 100 s stall against 2 s) held the next save ~7x too far away, after
    every restart. Now it takes the costs the run's event log holds (rank 0's last ``interval``
    event) and its first save counts for nothing; the step time is measured anew."""
    m = 1e6
    state = {"model": torch.nn.Linear(4, 4)}
    vt = _clock(monkeypatch, [2.0])
    first = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=10)
    with tg.CheckpointManager(tmp_path / "ck", save=first, keep=tg.KeepLatest(2)) as mgr:
        for step in range(2100):
            vt[0] += 1.0
            mgr.save(step, state)
    warm = round(daly_ref(2.0, m))
    assert first.interval_steps == warm and first.measurements()["stall_s"] == 2.0

    vt = _clock(monkeypatch, [100.0, 2.0])  # the new process: its first save is slow
    second = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=10)
    saved = []
    with tg.CheckpointManager(tmp_path / "ck", save=second, keep=tg.KeepLatest(2)) as mgr:
        start = mgr.restore(state)
        for step in range(start + 1, start + 40):
            vt[0] += 3.0  # another step time: measured anew, not the earlier process's
            if mgr.save(step, state) is not None:
                saved.append(step)
    assert saved == [start + 11]  # initial_steps after the first step seen, as in a new run
    assert second.interval_steps == round(daly_ref(2.0, m) / 3.0)  # not daly_ref(100, m) / 3 = 4,692
    assert second.measurements()["stall_s"] == 2.0
    ev = [e for e in read_events(tmp_path / "ck") if e["event"] == "interval"][-1]
    assert ev["steps"] == second.interval_steps and ev["stall_s"] == 2.0


def test_a_new_run_and_an_unusable_log_measure_as_before(tmp_path) -> None:
    """No log, a log without rank 0's measured interval (another policy, only ``initial``), a torn
    line: nothing is taken, and the first save's cost sets the interval as in a new run."""
    log = tmp_path / "events.jsonl"
    p = DalyInterval(node_mtbf_s=1e6, nodes=1)
    p.seed_from_log(log)  # none
    log.write_text('{"t": 1.0, "event": "interval", "rank": 0, "stall_s": null, "duration_s": null, "steps": 100}\n'
                   '{"t": 2.0, "event": "interval", "rank": 1, "stall_s": 5.0, "duration_s": 5.0, "steps": 7}\n'
                   '{"t": 3.0, "event": "interval", "rank": 0, "stall_s": 4.0, "dur')
    p.seed_from_log(log)
    assert p.measurements()["stall_s"] is None
    with open(log, "a") as f:
        f.write('\n{"t": 4.0, "event": "interval", "rank": 0, "stall_s": 4.0, "duration_s": 9.0, "slowdown_s": 1.0}\n')
    p.seed_from_log(log)
    assert p.measurements() == {"stall_s": 4.0, "slowdown_s": 1.0, "duration_s": 9.0, "step_time_s": None}


def test_plan_says_an_every_interval_shorter_than_an_async_saves_commit_delay_is_optimistic(tmp_path) -> None:
    """With ``--save-duration`` the efficiency counts the commit delay ``W`` as restart time, which holds
    only while one save is in flight (``W <= tau``). ``plan`` said so only when ``W`` passed the
    optimum; an ``--every`` interval shorter than ``W`` was printed with its formula efficiency and
    no word, though each of its saves waits for the previous one. The plot shades that range."""
    args = ["plan", "--nodes", "256", "--node-failures-per-day", "0.0065", "--save-stall", "30s", "--restart", "10m",
            "--step-time", "2s", "--save-duration", "10m"]
    out = CliRunner().invoke(main, [*args, "--every", "200,1000"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "more than the interval every 200 steps" in text and "optimistic" in text, text
    assert "every 9.5m of compute (285 steps)" in text
    quiet = CliRunner().invoke(main, [*args, "--every", "1000"])  # 1000 steps = 33 min > W: nothing to say
    assert quiet.exit_code == 0 and "One async save takes" not in quiet.output
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p.png"
    assert CliRunner().invoke(main, [*args, "--every", "200", "--plot", str(plot)]).exit_code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def drive_eval(policy: DalyInterval, n: int, *, slow_s: float) -> None:
    """An async manager on a fake clock (stall 0.1 s, write 300 s, steps of 0.5 s, ``slow_s`` while a
    write runs) whose loop also evaluates for 60 s every 1000 steps, saving or not."""
    policy.exact_durations = True
    clock, pending = 0.0, None
    for step in range(n):
        busy = pending is not None and clock < pending[2]
        clock += (slow_s if busy else 0.5) + (60.0 if step % 1000 == 999 else 0.0)
        policy.on_step(step, clock)
        if pending and clock >= pending[2]:
            policy.on_saved(pending[0], 0.1, pending[2] - pending[1])
            pending = None
        if policy.should_save(step, clock):
            if pending:
                waited = max(0.0, pending[2] - clock)
                clock += waited
                policy.on_saved(pending[0], 0.1, pending[2] - pending[1], waited_s=waited)
            pending = (step, clock, clock + 0.1 + 300.0)
            clock += 0.1


def test_an_evaluation_inside_a_saves_write_is_not_the_saves_cost() -> None:
    """A loop that evaluates for 60 s every 1000 steps (8 min) while an async save writes for 5 min:
    most writes overlap an evaluation, whose minute counted whole as the save's slowdown. The
    interval became Daly's for a 60 s save, 4917 steps (41 min), instead of the one-save floor,
    601 steps (5 min): saved 8 times too rarely. A GPU job (steps keep their speed) now measures no
    slowdown; a CPU-bound one still measures its slower steps (0.25 s each, ~400 of them), not the
    evaluation."""
    m = 86400 / (256 * 0.0065)
    p = DalyInterval(node_failures_per_day=0.0065, nodes=256, initial_steps=100)
    drive_eval(p, 100_000, slow_s=0.5)
    assert p.measurements()["slowdown_s"] == 0.0
    assert p.interval_steps == math.ceil(300.1 / 0.5) > round(daly_ref(0.1, m) / 0.5)
    q = DalyInterval(node_failures_per_day=0.0065, nodes=256, initial_steps=100)
    drive_eval(q, 100_000, slow_s=0.75)
    assert q.measurements()["slowdown_s"] == pytest.approx(0.25 * 300 / 0.75, rel=0.03)
    assert q.interval_steps == round(daly_ref(0.1 + q.measurements()["slowdown_s"], m) / 0.5)
