"""Review of the elastic / data-position path: each test reproduces a bug found there and failed
before its fix. Every process started here is bounded in time and killed by its pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import torch

from trainguard.elastic import launcher
from trainguard.elastic.launcher import build_parser
from trainguard.sampler import ResumableSampler

from conftest import run_py


def test_agent_fault_kills_the_agent_pid_not_the_parent():
    # With --start-method forkserver a worker's parent is the forkserver, not the agent: the
    # kind=agent drill killed the forkserver, the agent lived on and restarted its workers.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        worker = "from trainguard.elastic.faults import Fault, fire; fire(Fault(0, 0, 'agent'))"
        parent = (  # stands in for the forkserver: the worker's parent, but not its agent
            "import subprocess, sys; "
            f"print(subprocess.run([sys.executable, '-c', {worker!r}], timeout=60).returncode)"
        )
        p = run_py(["-c", parent], env={"TRAINGUARD_AGENT_PID": str(agent.pid)}, timeout=90)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == str(-signal.SIGKILL)  # the worker killed itself
        assert agent.wait(timeout=30) == -signal.SIGKILL  # and the agent
    finally:
        with contextlib.suppress(ProcessLookupError):
            agent.kill()
        agent.wait(timeout=30)


def test_report_on_a_foreign_or_binary_events_file_is_a_clear_error(tmp_path):
    # Lines of another tool's JSONL log (no "event"), JSON that is not an object, a "t" that is
    # no number, or undecodable bytes: `trainguard report` ended in a KeyError, AttributeError,
    # TypeError or UnicodeDecodeError traceback instead of its "no events" message.
    from click.testing import CliRunner

    from trainguard.cli import main

    for name, data in (("foreign", b'{"level": "info", "msg": "hello"}\n'), ("lists", b'[1, 2]\n"x"\n3\n'),
                       ("t", b'{"event": "step", "t": "noon", "step": 1}\n{"event": "x", "t": 2.0}\n'),
                       ("bytes", b'\xff\xfe{"a": 1}\n')):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "events.jsonl").write_bytes(data)
        res = CliRunner().invoke(main, ["report", str(run_dir)])
        if name == "t":  # the one real event is reported, the other line skipped
            assert res.exit_code == 0 and "wall time" in res.output, (name, res.output, res.exception)
        else:
            # one "error:" line, exit 2: an input error, as every other of the CLI (test_cli15_review)
            assert res.exit_code == 2 and "error: no events in" in res.output, (name, res.output, res.exception)


@pytest.mark.parametrize("flag, value", [("--hang-timeout", "0"), ("--hang-timeout", "-1"), ("--hang-timeout", "nan"),
                                         ("--hang-floor", "0"), ("--hang-floor", "-5"), ("--stop-timeout", "-1")])
def test_run_refuses_bad_watchdog_and_stop_seconds_in_the_parser(flag, value, capsys):
    # --hang-timeout 0 failed in every worker at its first heartbeat (ValueError), restarted
    # --max-restarts times; --hang-floor 0 or -5 made the auto timeout 0 s, so every worker was
    # declared hung 0.2 s after its first step; nan never fired at all.
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, value, "train.py"])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    args = build_parser().parse_args(["--hang-timeout", "2.5", "--hang-floor", "1", "--stop-timeout", "0", "x.py"])
    assert (args.hang_timeout, args.hang_floor, args.stop_timeout) == (2.5, 1.0, 0.0)


def test_sampler_takes_a_64_bit_seed_and_keeps_every_order_that_existed():
    # seed * 1_000_003 + epoch went to Generator.manual_seed as is: any seed >= ~2**44 (a 64-bit
    # one such as torch.initial_seed()) raised "Overflow when unpacking long long" at __iter__.
    for seed in (2**45, 2**63 + 5, 2**64 - 1):
        s = ResumableSampler(10, seed=seed, rank=1, world_size=2)
        assert sorted(s.order(0)) == sorted(s.order(1)) == list(range(10))
        assert list(s) == s.order(0)[1::2]
    for seed, epoch in ((0, 0), (7, 3), (-1, 0), (2**40, 1)):  # seeds that worked: the same order as before
        g = torch.Generator()
        g.manual_seed(seed * 1_000_003 + epoch)
        assert ResumableSampler(10, seed=seed).order(epoch) == torch.randperm(10, generator=g).tolist()


def test_run_with_a_run_dir_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch, capsys):
    # --run-dir naming a file (or a path under one): a FileExistsError traceback from os.makedirs.
    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare() writes the agent's environment
    script = tmp_path / "train.py"
    script.write_text("")
    for run_dir in (script, script / "sub"):
        with pytest.raises(SystemExit) as e:
            launcher.main(["--nproc-per-node", "1", "--run-dir", str(run_dir), str(script)])
        assert e.value.code == 2 and f"--run-dir {run_dir}: cannot create the directory" in capsys.readouterr().err


def test_a_fault_fires_again_in_a_new_job_when_the_rendezvous_id_is_torchruns_default(tmp_path, monkeypatch):
    # The marker was keyed on TORCHELASTIC_RUN_ID first: torchrun's default "none" (multi-node
    # without --rdzv-id, static rendezvous) was the same for every job, so a new job in the same
    # run directory never fired its drill again.
    from trainguard.elastic import faults

    f = faults.parse_fault("step=3,rank=0,kind=kill")
    monkeypatch.setenv("TRAINGUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "job-a")
    assert faults.claim(f) and not faults.claim(f)  # once per job: a restarted worker does not fire
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "job-b")
    assert faults.claim(f)  # a new job does
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-1")  # a real rendezvous id: the same on every node
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "node-2-launch")
    assert faults.claim(f) and not faults.claim(f)
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "node-3-launch")
    assert not faults.claim(f)
