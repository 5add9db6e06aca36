"""Review of "how often to save" (session 22): make_plan's inputs and what `trainguard plan` says
when even the optimum wastes most of the time."""

from __future__ import annotations

import pytest

from trainguard.reliability import make_plan

JOB = {"nodes": 64, "node_failures_per_day": 0.01, "stall_s": 30.0, "restart_s": 600.0}


@pytest.mark.parametrize("gpus", [-8, 2.5, True])
def test_make_plan_refuses_a_gpu_count_that_is_not_a_positive_integer(gpus: object) -> None:
    """Before: gpus_per_node=-8 gave -310.6 GPU-hours lost a day, 2.5 and True were used as counts; the
    CLI refuses them (IntRange(min=0)), the Python API did not. 0 (nodes without GPUs) is taken since
    session 49: the loss is then counted in node-hours (losthours.py, tests/test_hunt49_saveevent49.py)."""
    with pytest.raises(ValueError, match="gpus_per_node"):
        make_plan(**JOB, gpus_per_node=gpus)


def test_make_plan_counts_gpu_hours_for_a_valid_gpu_count() -> None:
    p = make_plan(**JOB, gpus_per_node=4)
    assert p.lost_gpu_hours_per_day == pytest.approx((1 - p.efficiency_at_daly) * 64 * 4 * 24)


def _last_line(args: str) -> str:
    from click.testing import CliRunner

    from trainguard.commands.plan import plan_cmd

    res = CliRunner().invoke(plan_cmd, args.split(), terminal_width=400)
    assert res.exit_code == 0, res.output
    return res.output.splitlines()[-1]


def test_a_hopeless_plan_blames_the_cause_that_costs_the_time() -> None:
    """Efficiency factorises exactly: E = e^(-R/M) * E(stall, R=0). A 30 s stall and a 116-day restart
    against a 37.5 h job MTBF: the restart alone keeps e^(-74) of the time, saving keeps 97.5 %. Before:
    "the save stall (30s) and restart (116d) exceed the job MTBF (37.5h). Cut the stall with async saves
    ... or a RAM tier", advice that changes nothing; the stall does not exceed the MTBF."""
    line = _last_line("--nodes 64 --node-failures-per-day 0.01 --save-stall 30s --restart 1e7")
    assert "restart (116d) alone keeps at most 0.00%" in line and "shorten the restart" in line, line
    assert "async saves" not in line and "RAM tier" not in line and "stall" not in line, line
    # a 3 min stall against a 1.44 min MTBF with a 1 s restart: the stall, not the restart
    line = _last_line("--nodes 1000 --node-failures-per-day 1 --save-stall 3m --restart 1s")
    assert "async saves" in line and "keeps 4.81%" in line and "shorten the restart" not in line, line
    # both matter: both are named, and fewer nodes always helps
    line = _last_line("--nodes 1000 --node-failures-per-day 1 --save-stall 1s --restart 3m")
    assert "keeps 85.55%" in line and "at most 12.45%" in line and "fewer nodes" in line, line


def _async_walk(tau: float, stall: float, delay: float, restart: float, mtbf: float, horizon: float, seed: int) -> float:
    """An independent event walk of async saves: compute ``tau``, stall ``stall``, the checkpoint commits
    ``delay`` after the stall while training goes on; a failure rolls back to the last committed one and
    costs ``restart`` (failures strike restarts too). Returns useful time / wall time."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t, committed, fail, restarting = 0.0, 0, rng.exponential(mtbf), False
    while t < horizon:
        if restarting:
            if fail < t + restart:
                t, fail = fail, fail + rng.exponential(mtbf)
                continue
            t, restarting = t + restart, False
        first = True
        while t < horizon:  # from a restart the first commit needs tau + stall + delay, then every tau + stall
            need = tau + stall + (delay if first else 0.0)
            if fail < t + need:
                t, fail, restarting = fail, fail + rng.exponential(mtbf), True
                break
            t, committed, first = t + need, committed + 1, False
    return committed * tau / t


def test_an_async_commit_delay_counts_as_restart_time_and_matches_a_simulation() -> None:
    """Before: the planner had no way to count an async save's commit delay (docs: "the planner does not
    count it ... a little lower"). With tau 1000 s, stall 30 s, a 10 min background write, a 10 min
    restart and a 5000 s job MTBF the walk gives 0.686 and the plan said 0.775 (make_plan had no
    save_duration_s: TypeError). Exactly, the delay adds to the restart: e^(-W/M) lower, same optimum."""
    import numpy as np

    walked = float(np.mean([_async_walk(1000.0, 30.0, 600.0, 600.0, 5000.0, 1e7, seed) for seed in range(4)]))
    job = {"nodes": 1, "node_mtbf_s": 5000.0, "stall_s": 30.0, "restart_s": 600.0}
    sync, async_ = make_plan(**job), make_plan(**job, save_duration_s=630.0)
    assert async_.commit_delay_s == 600.0 and async_.restart_s == 600.0
    assert async_.efficiency(1000.0) == pytest.approx(walked, rel=0.01)
    assert sync.efficiency(1000.0) > walked * 1.08  # what the plan said before: 9 points too high
    assert async_.optimal_interval_s == sync.optimal_interval_s
    assert async_.efficiency_at_optimum == pytest.approx(sync.efficiency_at_optimum * np.exp(-600.0 / 5000.0))


def test_plan_cli_takes_the_save_duration_and_refuses_one_shorter_than_the_stall() -> None:
    import json

    from click.testing import CliRunner

    from trainguard.commands.plan import plan_cmd

    base = "--nodes 64 --node-failures-per-day 0.05 --save-stall 5s --restart 10m --json".split()
    plain = json.loads(CliRunner().invoke(plan_cmd, base).output)
    res = CliRunner().invoke(plan_cmd, [*base, "--save-duration", "5m"])
    got = json.loads(res.output)
    assert got["commit_delay_s"] == 295.0 and plain["commit_delay_s"] == 0.0
    assert got["optimal_interval_s"] == plain["optimal_interval_s"]
    assert got["efficiency_at_optimum"] < plain["efficiency_at_optimum"] - 0.01
    res = CliRunner().invoke(plan_cmd, [*base, "--save-duration", "1s"])
    assert res.exit_code == 2 and "--save-duration 1s" in res.output and ">= the stall (5s)" in res.output, res.output


def test_plan_cli_says_when_one_async_save_outlasts_the_optimum() -> None:
    """A 1 h background write against an 8.6 min optimum: saving at the optimum would queue saves (each
    waits for the last), so the plan gives the shortest interval that keeps one save in flight.
    Before: nothing said so (no --save-duration at all)."""
    line = _last_line("--nodes 64 --node-failures-per-day 0.05 --save-stall 5s --restart 10m --step-time 1s "
                      "--save-duration 1h")
    assert "One async save takes 1h, more than the optimum interval" in line, line
    assert "no more often than every 59.9m of compute (3,595 steps)" in line, line
    quiet = _last_line("--nodes 64 --node-failures-per-day 0.05 --save-stall 5s --restart 10m --save-duration 5m")
    assert "One async save" not in quiet, quiet
