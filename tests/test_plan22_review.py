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
