"""The time a plan's failures and saves cost, in the unit its nodes have: GPU-hours, or node-hours
for nodes without GPUs (``gpus_per_node=0``, ``trainguard plan/doctor --gpus-per-node 0``).

Before, a CPU-only job could only be planned as 8 GPUs a node (the default), and ``plan`` and
``doctor`` printed "GPU-hours lost" for it; 0 was refused. Called by ``trainguard plan`` (its table
and ``--json``) and ``doctor.check_interval``, after ``reliability.make_plan``.
"""

from __future__ import annotations

from typing import Any

DEFAULT_GPUS = 8  # make_plan's, and the CLI's when --gpus-per-node is not given


def per_day(plan: Any) -> tuple[float, str]:
    """``(hours a fully idle day costs, unit)``: ``nodes × gpus_per_node × 24`` GPU-hours, or
    ``nodes × 24`` node-hours for nodes without GPUs. Lost = ``(1 − efficiency) ×`` the first."""
    if plan.gpus_per_node:
        return plan.nodes * plan.gpus_per_node * 24.0, "GPU-hours"
    return plan.nodes * 24.0, "node-hours"


def with_node_hours(d: dict[str, Any], plan: Any) -> dict[str, Any]:
    """``plan --json``: ``lost_node_hours_per_day`` next to ``lost_gpu_hours_per_day`` (0 without
    GPUs), for the whole plan (at Daly's interval) and for each row of ``intervals``."""
    day = plan.nodes * 24.0
    d["lost_node_hours_per_day"] = float(f"{(1.0 - plan.efficiency_at_daly) * day:.6g}")
    for row in d.get("intervals", []):
        row["lost_node_hours_per_day"] = float(f"{(1.0 - row['efficiency']) * day:.6g}")
    return d


def assumed_note(given: bool, plan: Any) -> str | None:
    """``plan``'s text output, ``--gpus-per-node`` not given: the GPU count the figures assume."""
    if given or not plan.gpus_per_node:
        return None
    return (f"GPU-hours assume {plan.gpus_per_node} GPUs per node: give --gpus-per-node N "
            "(0 for nodes without GPUs: node-hours).")
