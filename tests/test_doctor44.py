"""``trainguard doctor`` given some of the interval check's inputs says what else it needs: before,
``--step-time`` or ``--restart`` alone (no failure rate, no --save-stall) left the check out
without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd

SCRIPT = ("import trainguard.policies as pol\n\ndef trainguard_state():\n"
          "    return {}, {'root': '/tmp/r', 'save': pol.EveryNSteps(100)}\n")


def _interval(tmp_path: Path, args: list[str]) -> list[dict[str, str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json", *args])
    assert res.exit_code in (0, 1), res.output  # 1: the empty state has errors of its own
    return [f for f in json.loads(res.output) if f["check"] == "interval"]


@pytest.mark.parametrize(("args", "needs"), [
    (["--step-time", "2s"], ["failure rate", "--save-stall"]),
    (["--restart", "10m"], ["failure rate", "--save-stall"]),
    (["--node-failures-per-day", "0.01"], ["--save-stall"]),
    (["--save-stall", "30s", "--step-time", "2s"], ["failure rate"]),
])
def test_partial_interval_inputs_say_what_is_missing(tmp_path: Path, args: list[str], needs: list[str]) -> None:
    (f,) = _interval(tmp_path, args)
    assert f["severity"] == "info" and f["message"].startswith("not checked: it needs"), f
    for word in needs:
        assert word in f["message"], f
    if needs == ["--save-stall"]:
        assert "failure rate" not in f["message"]


def test_no_interval_inputs_no_interval_finding_and_all_inputs_a_verdict(tmp_path: Path) -> None:
    assert _interval(tmp_path, []) == []
    (f,) = _interval(tmp_path, ["--node-failures-per-day", "0.01", "--save-stall", "30s", "--step-time", "2s"])
    assert f["severity"] in ("ok", "warning") and "optimum" in f["message"], f
