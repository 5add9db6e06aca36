"""``trainguard verify RUN_DIR`` as an operator's cron job runs it while the job trains: a step
directory without a manifest (a save in progress on an object store, a crashed save not yet
removed) and a checkpoint that retention deletes during the check are not corruption."""

from __future__ import annotations

import json
import shutil

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import inspect as inspect_mod
from trainguard import layout
from trainguard.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _run_dir(root) -> None:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in (1, 2, 3):
            m.save(s, {"w": torch.full((64,), float(s))})


def test_a_save_in_progress_is_reported_incomplete_and_does_not_fail_verify(tmp_path):
    _run_dir(tmp_path)
    partial = tmp_path / layout.step_dir(4)  # what an object store holds while step 4 is written
    partial.mkdir()
    (partial / "data-00000.bin").write_bytes(b"x" * 100)
    r = _run("verify", tmp_path)
    assert r.exit_code == 0, r.output
    assert "INCOMPLETE" in r.output and "CORRUPT" not in r.output
    rows = json.loads(_run("verify", tmp_path, "--json").output)
    assert [(x["step"], x["status"], x["ok"]) for x in rows] == [
        (1, "valid", True), (2, "valid", True), (3, "valid", True), (4, "incomplete", False)]
    raw = bytearray((tmp_path / layout.step_dir(2) / "data-00000.bin").read_bytes())
    raw[0] ^= 1
    (tmp_path / layout.step_dir(2) / "data-00000.bin").write_bytes(bytes(raw))
    r = _run("verify", tmp_path, "--json")
    assert r.exit_code == 1 and [x["status"] for x in json.loads(r.output)] == ["valid", "corrupt", "valid", "incomplete"]


def test_a_checkpoint_deleted_by_retention_during_verify_does_not_fail_it(tmp_path, monkeypatch):
    _run_dir(tmp_path)

    real = inspect_mod.verify

    def verify_after_retention(path):
        if str(path).endswith(layout.step_dir(1)):
            shutil.rmtree(path)  # the job's retention removed it after verify listed it
        return real(path)

    # the command imports inspect.verify when it runs (torch: not at `trainguard --help`, test_hunt50_import50.py)
    monkeypatch.setattr(inspect_mod, "verify", verify_after_retention)
    r = _run("verify", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [(1, "deleted"), (2, "valid"), (3, "valid")]


def test_verify_of_a_run_dir_without_checkpoints_says_so(tmp_path):
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 2 and "no checkpoint" in r.output and "crashed" not in r.output


def test_a_run_dir_of_incomplete_steps_only_fails_verify(tmp_path):
    (tmp_path / layout.step_dir(5)).mkdir()  # a crashed save, and nothing committed
    (tmp_path / layout.step_dir(5) / "data-00000.bin").write_bytes(b"x")
    r = _run("verify", tmp_path)
    assert r.exit_code == 1 and "INCOMPLETE" in r.output and "no committed checkpoint verified" in r.output
