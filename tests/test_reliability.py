"""The reliability planner: closed forms, the Monte Carlo check, and ``trainguard plan``."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard import reliability as rel
from trainguard.commands.plan import plan_cmd

DOC = Path(__file__).resolve().parents[1] / "docs" / "planning.md"
EXAMPLE = "--nodes 256 --node-failures-per-day 0.0065 --save-stall 30s --restart 10m --step-time 2s"


def test_parse_duration() -> None:
    assert rel.parse_duration("30s") == 30
    assert rel.parse_duration("10m") == 600
    assert rel.parse_duration("2.5h") == 9000
    assert rel.parse_duration("400d") == 400 * 86400
    assert rel.parse_duration("250ms") == 0.25
    assert rel.parse_duration("1w") == 7 * 86400
    assert rel.parse_duration("42") == 42
    for bad in ("", "ten minutes", "5 parsecs", "-3s"):
        with pytest.raises(ValueError, match="duration"):
            rel.parse_duration(bad)


def test_job_mtbf_and_failure_probability() -> None:
    m = rel.job_mtbf(nodes=256, node_failures_per_day=0.0065)
    assert m == pytest.approx(86400 / (256 * 0.0065))
    assert rel.job_mtbf(nodes=4, node_mtbf_s=400 * 86400) == pytest.approx(100 * 86400)
    assert rel.p_failure(86400, m) == pytest.approx(1 - math.exp(-256 * 0.0065))
    assert rel.p_failure(7 * 86400, m) > rel.p_failure(86400, m)
    with pytest.raises(ValueError, match="exactly one"):
        rel.job_mtbf(nodes=1, node_failures_per_day=1.0, node_mtbf_s=10.0)
    with pytest.raises(ValueError, match="exactly one"):
        rel.job_mtbf(nodes=1)
    with pytest.raises(ValueError, match="node count"):
        rel.job_mtbf(nodes=0, node_failures_per_day=1.0)


def test_young_and_daly_closed_forms() -> None:
    assert rel.young_interval(30, 50_000) == pytest.approx(math.sqrt(2 * 30 * 50_000))
    x = 30 / 100_000
    expected = math.sqrt(2 * 30 * 50_000) * (1 + math.sqrt(x) / 3 + x / 9) - 30
    assert rel.daly_interval(30, 50_000) == pytest.approx(expected)
    assert rel.daly_interval(5000, 2000) == 2000  # stall >= 2M: Daly says save every M


@pytest.mark.parametrize("stall, mtbf", [(1, 1e6), (30, 51923), (600, 36000), (600, 3600), (1200, 3600)])
def test_exact_optimum_is_a_maximum_and_daly_is_close(stall: float, mtbf: float) -> None:
    opt = rel.optimal_interval(stall, mtbf)
    e = rel.efficiency(opt, stall, 600, mtbf)
    assert e > rel.efficiency(opt * 1.01, stall, 600, mtbf)
    assert e > rel.efficiency(opt * 0.99, stall, 600, mtbf)
    daly = rel.daly_interval(stall, mtbf)
    assert abs(daly / opt - 1) < 0.01
    # Daly's estimate is at least as good as Young's first-order one
    assert rel.efficiency(daly, stall, 600, mtbf) >= rel.efficiency(rel.young_interval(stall, mtbf), stall, 600, mtbf)


def test_efficiency_limits() -> None:
    # no failures: only the stall costs
    assert rel.efficiency(100, 10, 600, 1e15) == pytest.approx(100 / 110, rel=1e-9)
    # first order for rare failures: t/(t+d) * (1 - (t+d)/2M - R/M)
    t, d, r, m = 1000.0, 10.0, 60.0, 1e7
    assert rel.efficiency(t, d, r, m) == pytest.approx(t / (t + d) * (1 - (t + d) / (2 * m) - r / m), abs=1e-7)
    arr = rel.efficiency([100, 1000], 10, 60, 1e5)
    assert arr.shape == (2,) and arr[0] < arr[1]


# (mtbf, stall, restart) x interval factors around Daly's optimum; efficiencies from ~0.3 to 0.99
GRID = [(3600, 10, 60), (3600, 60, 1800), (3600, 600, 60), (36000, 60, 600), (36000, 600, 1800),
        (360000, 10, 1800), (360000, 600, 60)]


def test_closed_form_matches_monte_carlo_within_one_percent() -> None:
    worst = 0.0
    for i, (m, d, r) in enumerate(GRID):
        daly = rel.daly_interval(d, m)
        for k in (0.25, 1.0, 4.0):
            tau = k * daly
            sim = rel.simulate(interval_s=tau, stall_s=d, restart_s=r, mtbf_s=m, runs=3000, seed=1000 + i)
            exact = rel.efficiency(tau, d, r, m)
            worst = max(worst, abs(sim.efficiency / exact - 1))
            assert sim.efficiency == pytest.approx(exact, rel=0.01), (m, d, r, tau)
            assert sim.failures_per_run > 10  # every run saw failures: the check is not vacuous
    assert worst < 0.01


def test_monte_carlo_tells_a_wrong_formula_apart() -> None:
    """Where failures are frequent, Young's first-order efficiency misses the simulation by > 1%."""
    m, d, r = 3600.0, 600.0, 1800.0
    tau = rel.daly_interval(d, m)
    sim = rel.simulate(interval_s=tau, stall_s=d, restart_s=r, mtbf_s=m, runs=3000, seed=7)
    first_order = tau / (tau + d) * (1 - (tau + d) / (2 * m) - r / m)
    assert abs(first_order / sim.efficiency - 1) > 0.05
    assert sim.efficiency == pytest.approx(rel.efficiency(tau, d, r, m), rel=0.01)


def test_simulate_without_failures_and_is_seeded() -> None:
    sim = rel.simulate(interval_s=100, stall_s=25, restart_s=60, mtbf_s=1e15, work_s=10_000, runs=10)
    assert sim.efficiency == pytest.approx(100 / 125)
    assert sim.failures_per_run == 0
    a = rel.simulate(interval_s=50, stall_s=5, restart_s=5, mtbf_s=500, runs=200, seed=3)
    b = rel.simulate(interval_s=50, stall_s=5, restart_s=5, mtbf_s=500, runs=200, seed=3)
    assert a == b
    with pytest.raises(ValueError):
        rel.simulate(interval_s=0, stall_s=1, restart_s=1, mtbf_s=10)


def test_make_plan_figures() -> None:
    p = rel.make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600, step_time_s=2,
                      gpus_per_node=4, intervals={"a": 1000.0})
    m = 86400 / (256 * 0.0065)
    assert p.job_mtbf_s == pytest.approx(m)
    assert p.daly_interval_s == pytest.approx(rel.daly_interval(30, m))
    assert p.efficiency_at_daly == pytest.approx(rel.efficiency(p.daly_interval_s, 30, 600, m))
    assert p.lost_gpu_hours_per_day == pytest.approx((1 - p.efficiency_at_daly) * 256 * 4 * 24)
    assert p.rows[0].steps == 500 and p.rows[0].efficiency < p.efficiency_at_daly
    d = p.to_dict()
    assert d["daly_interval_steps"] == round(p.daly_interval_s / 2)
    assert d["job_mtbf_hours"] == pytest.approx(m / 3600, rel=1e-5)
    with pytest.raises(ValueError, match="step_time"):
        rel.make_plan(nodes=1, node_failures_per_day=1, stall_s=1, restart_s=1, step_time_s=0)


def _run(args: str) -> dict:
    res = CliRunner().invoke(plan_cmd, shlex.split(args))
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_cli_json_keys_and_intervals() -> None:
    d = _run(EXAMPLE + " --every 500,1000,1h --json")
    for key in ("p_failure_day", "p_failure_week", "job_mtbf_hours", "young_interval_s", "daly_interval_s",
                "efficiency_at_daly", "lost_gpu_hours_per_day"):
        assert isinstance(d[key], float), key
    assert [r["steps"] for r in d["intervals"]] == [500, 1000, 1800]
    assert [r["interval_s"] for r in d["intervals"]] == [1000.0, 2000.0, 3600.0]
    assert all(r["efficiency"] < d["efficiency_at_daly"] for r in d["intervals"])
    # the same failure rate given as a node MTBF gives the same figures; 16 GPUs double the loss
    mtbf_days = 1 / 0.0065
    e = _run(f"--nodes 256 --node-mtbf {mtbf_days}d --save-stall 30s --restart 10m --gpus-per-node 16 --json")
    assert e["daly_interval_s"] == pytest.approx(d["daly_interval_s"], rel=1e-5)
    assert e["lost_gpu_hours_per_day"] == pytest.approx(2 * d["lost_gpu_hours_per_day"], rel=1e-5)
    assert e["daly_interval_steps"] is None


@pytest.mark.parametrize("args, message", [
    ("--nodes 2 --save-stall 30s --restart 1m", "exactly one"),
    ("--nodes 2 --node-mtbf 10d --node-failures-per-day 1 --save-stall 30s --restart 1m", "exactly one"),
    ("--node-mtbf 10d --save-stall 30s --restart 1m --every 500", "--step-time"),
    ("--node-mtbf 10d --save-stall thirty --restart 1m", "duration"),
])
def test_plan_cli_rejects_bad_input(args: str, message: str) -> None:
    res = CliRunner().invoke(plan_cmd, shlex.split(args))
    assert res.exit_code == 2 and message in res.output


def test_plan_cli_tables_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "eff.png"
    res = CliRunner().invoke(plan_cmd, shlex.split(EXAMPLE + f" --every 500 --plot {out}"), terminal_width=120)
    assert res.exit_code == 0, res.output
    assert "optimum (exact)" in res.output and "Daly (estimate)" in res.output and "every 500 steps" in res.output and "873" in res.output
    assert "81.1%" in res.output  # P(>= 1 failure) per day
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_documented_example_runs_and_matches_the_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    cmd = next(line for line in text.splitlines() if line.startswith("$ trainguard plan") and "--json" in line)
    documented = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    got = _run(cmd.removeprefix("$ trainguard plan"))
    assert set(documented) == set(got)
    for key, value in documented.items():
        if key == "intervals":
            assert [r["label"] for r in got[key]] == [r["label"] for r in value]
            for g, v in zip(got[key], value, strict=True):
                assert g["efficiency"] == pytest.approx(v["efficiency"], rel=1e-5)
        else:
            assert got[key] == pytest.approx(value, rel=1e-5), key
