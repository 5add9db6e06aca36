"""Audit of the save-interval advice (round 35): inputs the formulas took without a word, a Monte Carlo
walk that never ended, and a step time of inf. The formulas themselves held: an independent simulation
agreed with the expected-time model within its standard error for stall/MTBF from 1e-4 to 0.5."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from click.testing import CliRunner

from trainguard import reliability as rel
from trainguard.commands.plan import plan_cmd

H = 3600.0


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: simulate() used to loop for hours (its loop is Python, so SIGALRM gets in)."""
    def _raise(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("stall, restart", [(math.inf, 0.0), (0.0, math.inf), (30 * H, 0.0), (30.0, 20 * H)])
def test_simulate_refuses_what_it_cannot_finish_at_once(stall: float, restart: float) -> None:
    """An infinite stall or restart was accepted and looped forever; a stall of 30 MTBFs (e^30 failures an
    interval, efficiency ~1e-13) looped for hours. Now a ValueError at once, giving the exact efficiency."""
    with _deadline(5.0), pytest.raises(ValueError, match="stall_s=inf|restart_s=inf|efficiency"):
        rel.simulate(interval_s=100.0, stall_s=stall, restart_s=restart, mtbf_s=H, runs=50)
    got = rel.simulate(interval_s=100.0, stall_s=30.0, restart_s=60.0, mtbf_s=H, runs=50, seed=1)
    assert got.efficiency == pytest.approx(rel.efficiency(100.0, 30.0, 60.0, H), abs=4 * got.stderr)


def test_efficiency_refuses_a_negative_interval_or_restart() -> None:
    """efficiency(-600, ...) was 1.14 (more useful time than wall time), a restart of -100 s raised the
    efficiency above the instant restart's, nan gave nan: now each is a ValueError naming the input."""
    assert rel.efficiency(600.0, 30.0, 0.0, H) < 1.0
    for args, name in [((-600.0, 30.0, 0.0), "interval_s=-600"), ((math.nan, 30.0, 0.0), "interval_s=nan"),
                       ((math.inf, 30.0, 0.0), "interval_s=inf"), ((600.0, 30.0, -100.0), "restart_s=-100"),
                       ((600.0, 30.0, math.nan), "restart_s=nan"), ((np.array([60.0, -1.0]), 30.0, 0.0), "interval_s")]:
        with pytest.raises(ValueError, match=name):
            rel.efficiency(*args, H)
        with pytest.raises(ValueError, match=name):
            rel.expected_wall_time(*args, H)
    assert rel.efficiency(np.array([60.0, 600.0]), 30.0, 60.0, H).shape == (2,)  # arrays still work (plot_plan)


def test_p_failure_refuses_a_negative_or_nan_period() -> None:
    assert rel.p_failure(86400.0, 86400.0) == pytest.approx(1 - math.exp(-1))
    assert rel.p_failure(math.inf, H) == 1.0
    for period in (-10.0, math.nan):  # were -0.0028 and nan: a probability out of [0, 1]
        with pytest.raises(ValueError, match="period_s"):
            rel.p_failure(period, H)


def test_non_numbers_get_an_error_that_says_what_to_write() -> None:
    """A string gave Python's "'<=' not supported between instances of 'int' and 'str'"; True counted as 1."""
    with pytest.raises(ValueError, match=r"stall_s='30'.*parse_duration"):
        rel.daly_interval("30", H)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stall_s=True"):
        rel.young_interval(True, H)
    with pytest.raises(ValueError, match="mtbf_s=None"):
        rel.optimal_interval(30.0, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"node_mtbf_s='400d'.*parse_duration"):
        rel.job_mtbf(nodes=1, node_mtbf_s="400d")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node_failures_per_day='0.01'"):
        rel.job_mtbf(nodes=1, node_failures_per_day="0.01")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stall_s='30s'"):
        rel.make_plan(nodes=1, node_failures_per_day=0.01, stall_s="30s", restart_s=60)  # type: ignore[arg-type]


def test_node_counts() -> None:
    """nodes=True was one node; a numpy integer (an array's size, a computed count) was refused; 10**400
    nodes raised an OverflowError."""
    with pytest.raises(ValueError, match="nodes=True"):
        rel.job_mtbf(nodes=True, node_mtbf_s=86400.0)
    got = rel.job_mtbf(nodes=np.int64(4), node_mtbf_s=86400.0)
    assert got == 21600.0 and type(got) is float
    with pytest.raises(ValueError, match="nodes=10\\^400.*too small"):
        rel.job_mtbf(nodes=10**400, node_mtbf_s=86400.0)


def test_an_infinite_step_time_is_refused() -> None:
    """--step-time 1e400 reads as inf: every interval was printed as 1 step."""
    with pytest.raises(ValueError, match="step_time_s=inf"):
        rel.make_plan(nodes=1, node_failures_per_day=0.01, stall_s=30, restart_s=60, step_time_s=math.inf)
    res = CliRunner().invoke(plan_cmd, "--node-failures-per-day 0.01 --save-stall 30s --restart 1m --step-time 1e400"
                             .split())
    assert res.exit_code == 2 and "'--step-time': 1e400: a finite duration > 0" in res.output, res.output  # polish58's wording


def test_python_dash_m_trainguard_runs_the_command() -> None:
    """`python -m trainguard plan ...` said "No module named trainguard.__main__" (only `python -m
    trainguard.cli` and the `trainguard` script worked): where the script is not on PATH, -m is the way."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainguard", "plan", "--node-failures-per-day", "0.0065",
                          "--nodes", "256", "--save-stall", "30s", "--restart", "10m", "--json"],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert '"daly_interval_s": 1745.1' in out.stdout
