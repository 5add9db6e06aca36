"""Review of "how often to save" (session 22): make_plan's inputs and what `trainguard plan` says
when even the optimum wastes most of the time."""

from __future__ import annotations

import pytest

from trainguard.reliability import make_plan

JOB = {"nodes": 64, "node_failures_per_day": 0.01, "stall_s": 30.0, "restart_s": 600.0}


@pytest.mark.parametrize("gpus", [0, -8, 2.5, True])
def test_make_plan_refuses_a_gpu_count_that_is_not_a_positive_integer(gpus: object) -> None:
    """Before: gpus_per_node=-8 gave -310.6 GPU-hours lost a day, 0 gave 0.0 (no loss at all),
    2.5 and True were used as counts; the CLI refuses them (IntRange(min=1)), the Python API did not."""
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
