"""Review of the documentation changed on 2026-12-02 (docs14): claims checked by running them."""

from __future__ import annotations

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import layout
from trainguard.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_verify_of_a_run_directory_names_the_checkpoints_it_does_not_check_but_a_restart_restores(tmp_path):
    """docs/checkpoints.md: ls names a ``step-N.old-<id>`` (an overwrite cut short) that the next
    manager puts back. ``trainguard verify`` of the same run directory said it 'holds no checkpoint'
    (or, beside steps 1-2, nothing at all of step 3) while a restart resumes from step 3."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((8,), float(s))})
    old = f"{layout.step_dir(3)}.old-ab12"
    (run / layout.step_dir(3)).rename(run / old)
    r = _run("verify", run)
    assert r.exit_code == 0 and f"not listed: {old}" in r.output.replace("\n", " "), r.output

    alone = tmp_path / "alone"
    alone.mkdir()
    (run / old).rename(alone / old)
    r = _run("verify", alone)
    assert r.exit_code == 2 and old in r.output and "holds no checkpoint:" not in r.output, r.output
    assert _run("verify", alone / old).exit_code == 0
    st = {"w": torch.zeros(8)}
    with tg.CheckpointManager(alone, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        assert mgr.restore(st) == 3  # what verify now names is what a restart resumes from
    assert torch.equal(st["w"], torch.full((8,), 3.0))


def _reseed(src: str):
    from trainguard.doctor import Settings
    from trainguard.doctor_source import reseed

    return reseed([], Settings(source=src))


_HEAD = "import torch, trainguard as tg\ndef main(mgr, state):\n"


def test_doctor_rng_after_restore_exempts_only_the_fresh_start_branch():
    """docs/planning.md, 'rng after restore': a seed after the restore is fine only 'outside an if on
    the restore's result (`if start is None:`, a fresh start)'. Every branch of any if on the
    result was exempt: a seed set only on a resume (`if start is not None:`, the else of
    `if start is None:`), which is exactly what overwrites the restored RNG, was 'ok'; and the
    same fresh-start seed tested on the call itself (`if mgr.restore(state) is None:`) was a warning."""
    resumed_only = [
        "    start = mgr.restore(state)\n    if start is not None:\n        torch.manual_seed(0)\n",
        "    start = mgr.restore(state)\n    if start is None:\n        pass\n    else:\n        torch.manual_seed(1)\n",
        "    start = mgr.restore(state)\n    if start:\n        torch.manual_seed(0)\n",
        "    if mgr.restore(state) is not None:\n        torch.manual_seed(0)\n",
    ]
    for body in resumed_only:
        f = _reseed(_HEAD + body)
        assert f is not None and f.severity == "warning", body
    fresh_only = [
        "    start = mgr.restore(state)\n    if start is None:\n        torch.manual_seed(0)\n",
        "    start = mgr.restore(state)\n    if not start:\n        torch.manual_seed(0)\n",
        "    start = mgr.restore(state)\n    if start is not None:\n        pass\n    else:\n        torch.manual_seed(0)\n",
        "    if mgr.restore(state) is None:\n        torch.manual_seed(0)\n",
    ]
    for body in fresh_only:
        f = _reseed(_HEAD + body)
        assert f is not None and f.severity == "ok", body
