"""Planner edge cases: a stall far beyond the job's MTBF, zero intervals to compare, CLI error wording."""

from __future__ import annotations

import json
import warnings

import pytest
from click.testing import CliRunner

from trainguard import reliability as rel
from trainguard.commands.plan import plan_cmd


def test_optimum_when_the_stall_dwarfs_the_mtbf() -> None:
    # 10^6 nodes failing once a day: job MTBF 0.0864 s, a 30 s stall (delta/M ~ 350 and ~ 7000)
    assert 0.99 * 0.0864 < rel.optimal_interval(30.0, 0.0864) < 0.0864
    assert 0.99 * 0.004 < rel.optimal_interval(30.0, 0.004) < 0.004  # e^(7500) overflowed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning leaks to the user
        assert rel.efficiency(60.0, 30.0, 600.0, 0.004) == 0.0
    res = CliRunner().invoke(plan_cmd, ["--nodes", "20000000", "--node-failures-per-day", "1", "--save-stall", "30s",
                                        "--restart", "10m", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["efficiency_at_optimum"] == 0.0 and got["p_failure_day"] == 1.0


def test_every_zero_is_refused() -> None:
    for every, step in (("0", ["--step-time", "1s"]), ("0s", []), ("10m,0", [])):
        res = CliRunner().invoke(plan_cmd, ["--node-failures-per-day", "1", "--save-stall", "30s", "--restart", "1m",
                                            "--every", every, *step])
        assert res.exit_code == 2 and "--every" in res.output, (every, res.output)


def test_cli_errors_name_the_options_not_python_parameters() -> None:
    cases = [("--node-mtbf 0 --save-stall 30s --restart 1m", "'--node-mtbf': 0: a finite", "node_mtbf_s"),  # polish58: as parsed
             ("--node-failures-per-day -1 --save-stall 30s --restart 1m", "'--node-failures-per-day': -1: a finite",
              "node_failures_per_day"),
             ("--node-failures-per-day 1 --save-stall 0s --restart 1m", "'--save-stall': 0s: a finite", "stall_s"),
             ("--node-failures-per-day 1 --save-stall 30s --restart 1m --step-time 0", "'--step-time': 0: a finite", "step_time_s")]
    for args, want, internal in cases:
        res = CliRunner().invoke(plan_cmd, args.split())
        assert res.exit_code == 2 and want in res.output and internal not in res.output, (args, res.output)
    with pytest.raises(ValueError, match="stall_s=0"):  # the Python API keeps its parameter names
        rel.make_plan(nodes=1, node_failures_per_day=1, stall_s=0, restart_s=0)


def test_text_output_shows_the_exact_optimum_and_advises_when_it_is_hopeless() -> None:
    # 1000 nodes failing once a day: job MTBF 86.4 s; a 3 min stall (>= 2 MTBF): Daly says 86.4 s,
    # the exact optimum is 82.2 s (1.37m), and even there almost nothing gets done
    args = "--nodes 1000 --node-failures-per-day 1 --save-stall 3m --restart 10m".split()
    res = CliRunner().invoke(plan_cmd, args, terminal_width=200)
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line for line in res.output.splitlines() if line.count("│") > 3}
    assert "1.37m" in rows["optimum (exact)"] and "1.44m" in rows["Daly (estimate)"]
    assert "Daly (optimum)" not in res.output
    assert "1,000" in res.output and "e+" not in res.output  # expected failures per day
    assert "async saves" in res.output and "RAM tier" in res.output and "fewer nodes" in res.output
    res = CliRunner().invoke(plan_cmd, "--nodes 256 --node-failures-per-day 0.0065 --save-stall 30s --restart 10m"
                             .split(), terminal_width=200)
    assert res.exit_code == 0 and "fewer nodes" not in res.output and "1.66" in res.output


def test_load_of_a_step_whose_overwrite_was_cut_short_names_its_previous_copy(tmp_path):
    """A crash between the two renames of ``overwrite=True`` leaves ``step-N`` missing and its
    previous checkpoint at ``step-N.old-<id>`` until a manager opens; ``tg.load`` said only "no
    such checkpoint directory"."""
    import torch

    import trainguard as tg
    from trainguard.errors import NotACheckpointError

    step = tmp_path / "run" / "step-000000005"
    tg.save(step, {"w": torch.arange(3.0)})
    old = step.parent / "step-000000005.old-1a2b"
    step.rename(old)  # where _commit's first rename put it
    got = {"w": torch.zeros(3)}
    with pytest.raises(NotACheckpointError, match=r"overwrite of it was cut short.*step-000000005\.old-1a2b"):
        tg.load(step, got)
    tg.load(old, got)
    assert torch.equal(got["w"], torch.arange(3.0))
    with tg.CheckpointManager(step.parent):  # puts it back
        pass
    assert (step / "manifest.json").exists() and not old.exists()
