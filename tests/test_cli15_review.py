"""The ``trainguard`` command in shell scripts: exit codes a ``set -o pipefail`` script or a
requeue wrapper can trust (a closed pipe is not a failed verification; every usage error is one
``error:`` line and exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main
from trainguard.tiers import ram_dir

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _run_dir(root, steps=(1, 2, 3)) -> None:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in steps:
            m.save(s, {"model": {f"w{i}": torch.full((8,), float(s)) for i in range(50)}})


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """``trainguard ARGS | head -0``, deterministic: the pipe's read end is closed before the
    command starts, so its first write to stdout fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC))
    try:
        return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              env=env, timeout=120, text=True)
    finally:
        os.close(w)


@pytest.mark.parametrize("cmd", [["verify"], ["ls", "--json"],  # rich's output, and click's
                                 pytest.param(["inspect"], marks=pytest.mark.slow)])  # rich again: make test-slow
def test_output_into_a_closed_pipe_exits_with_the_commands_own_code(tmp_path, cmd):
    _run_dir(tmp_path / "run")
    target = tmp_path / "run" / ("step-000000003" if cmd[0] == "inspect" else "")
    p = _into_closed_pipe(*cmd, str(target))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr


def test_verify_into_a_closed_pipe_still_fails_a_corrupt_run(tmp_path):
    _run_dir(tmp_path / "run")
    data = next(f for f in (tmp_path / "run" / "step-000000003").iterdir() if f.name != "manifest.json")
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # every byte: no padding left unchanged
    p = _into_closed_pipe("verify", str(tmp_path / "run"))
    assert p.returncode == 1, p.stderr  # the verdict, checked to the end: not 0 because the reader left


def _one_error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_report_of_a_directory_without_events_is_one_error_line_exit_2(tmp_path):
    assert "no events in" in _one_error_line(_run("report", tmp_path))


def test_demo_with_a_fault_step_beyond_its_steps_is_one_error_line_exit_2():
    assert "fault step 50" in _one_error_line(_run("demo", "--steps", "10", "--fault-step", "50", "--size", "tiny"))


def test_demo_with_negative_steps_is_a_usage_error_before_anything_runs():
    r = _run("demo", "--steps", "-1")
    assert r.exit_code == 2 and "--steps" in r.output and "-1 is not in the range" in r.output, r.output


def test_demo_whose_training_run_fails_says_error_and_exits_1(monkeypatch):
    from trainguard.demo import driver

    def failed(**kw):  # noqa: ANN003
        raise RuntimeError("the faulty run failed (exit code 1); its log ends with:\nboom")

    monkeypatch.setattr(driver, "run_demo", failed)
    r = _run("demo", "--size", "tiny")
    assert r.exit_code == 1 and r.output.startswith("error: the faulty run failed"), r.output


@pytest.mark.parametrize("cmd", [["export", "{ckpt}", "--to", "s3://bucket/run/model.safetensors"],
                                 ["convert", "{ckpt}", "s3://bucket/run/model.pt"],
                                 ["convert", "{ckpt}", "memory://bucket/dcp_out", "--to", "dcp"]])
def test_export_or_convert_to_an_object_store_url_says_outputs_are_local(tmp_path, cmd):
    # They said "the directory <cwd>/s3:/bucket/run does not exist; create it first": the URL
    # taken for a local path, and an operator told to create a directory named "s3:".
    _run_dir(tmp_path / "run", steps=(1,))
    r = _run(*[a.format(ckpt=tmp_path / "run" / "step-000000001") for a in cmd])
    line = _one_error_line(r)
    assert "local path only" in line and "create it first" not in line, line


def _ram_only_step_2(tmp_path):
    """A run whose step 2 is in its RAM tier only: the job died before the background copy to
    disk (simulated: the manager keeps its RAM tier, then the durable step 2 is removed)."""
    from trainguard.storage.local import LocalStorage

    base, run = tmp_path / "shm", tmp_path / "run"
    base.mkdir()
    m = tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepAll(), ram_tier=str(base), handle_signals=False)
    m.open()
    for s in (1, 2):
        m.save(s, {"model": {"w": torch.full((8,), float(s))}})
    m.close(keep_ram_tier=True)
    LocalStorage().remove_tree(str(run / "step-000000002"))
    # ... and the RAM tier's record that step 2 reached disk, which a copy cut short never writes
    # (with it, restore discards the RAM copy as one removed from the run directory since).
    os.remove(os.path.join(ram_dir(str(run), str(base)), ".trainguard-on-disk"))
    return base, run


def test_ls_shows_steps_held_only_in_the_ram_tier(tmp_path):
    # ls listed step 1 alone: an operator deciding whether the job can resume on this node from
    # step 2 (restore tries the RAM copy first) did not see it.
    base, run = _ram_only_step_2(tmp_path)
    r = _run("ls", run, "--ram-tier", base)
    assert r.exit_code == 0 and "RAM tier" in r.output and "in RAM only" in r.output and "step(s) 2" in r.output, r.output
    rows = json.loads(_run("ls", run, "--ram-tier", base, "--json").output)
    assert [(x["step"], x["status"], x["tier"]) for x in rows] == [(1, "valid", "durable"), (2, "valid", "ram")]
    with tg.CheckpointManager(run, ram_tier=str(base), handle_signals=False) as m:  # what ls said: step 2 resumes
        assert m.restore({"model": {"w": torch.zeros(8)}}) == 2


def test_ls_does_not_show_a_ram_tier_of_a_deleted_run_directory(tmp_path):
    # The next manager discards a RAM tier whose run id differs (the run directory was deleted to
    # start over): ls must not offer it as a resume point.
    base, run = _ram_only_step_2(tmp_path)
    (run / ".trainguard-run-id").write_text("another run")
    r = _run("ls", run, "--ram-tier", base)
    assert r.exit_code == 0 and "RAM" not in r.output, r.output


def test_commands_on_a_run_directory_whose_name_is_not_utf8(tmp_path):
    # A directory named on a Latin-1 system (byte 0xff): Python decodes it with surrogateescape,
    # and printing it to a stdout with errors="strict" (a UTF-8 locale; CliRunner's) raised
    # UnicodeEncodeError: a traceback, exit 1, for ls, verify and inspect. ls also hashed the path
    # with str.encode() to find the RAM tier. The byte is now shown as \xff.
    run = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"run\xff"))
    _run_dir(run, steps=(1,))
    for args in (["ls", run], ["verify", run], ["inspect", os.path.join(run, "step-000000001")]):
        r = _run(*args)
        assert r.exit_code == 0 and "xff" in r.output, (args, r.output, r.exception)
