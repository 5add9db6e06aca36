"""trainguard run: fault spec parsing, launcher defaults, and a real hang drill (torchrun, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainguard.elastic.faults import Fault, FaultSpecError, claim, parse_fault
from trainguard.elastic.launcher import build_parser, prepare, root_failure
from trainguard.elastic.watchdog import HANG_EXIT, Watchdog
from trainguard.events import read_events


def test_parse_fault_and_errors():
    assert parse_fault("step=743,rank=1,kind=kill") == Fault(743, 1, "kill")
    assert parse_fault("step=5") == Fault(5, 0, "kill")
    for bad, msg in (("rank=1", "step=N is required"), ("step=1,kind=boom", "kind must be"),
                     ("step=x", "integers"), ("step=1,when=now", "cannot read")):
        with pytest.raises(FaultSpecError, match=msg):
            parse_fault(bad)


def test_fault_fires_once_per_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    f = Fault(3, 0, "exit")
    assert claim(f) and not claim(f)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # a new job in the same run dir fires again
    assert claim(f)


def test_a_fault_for_a_rank_the_job_does_not_have_is_a_warning_on_rank_0(monkeypatch):
    """``--fault step=10,rank=5`` on a 2-rank job never fired, and nothing said so."""
    from trainguard.elastic.watchdog import _Heart

    monkeypatch.delenv("TRAINGUARD_RUN_DIR", raising=False)
    monkeypatch.delenv("TRAINGUARD_WATCHDOG", raising=False)  # each _Heart() would start a watchdog thread, never stopped
    monkeypatch.setenv("TRAINGUARD_FAULT", "step=10,rank=5,kind=exit;step=3,rank=1,kind=exit")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"'step=10,rank=5,kind=exit' does not fire while this job has 2 rank") as got:
        _Heart()
    assert len(got) == 1  # rank=1 exists
    monkeypatch.setenv("RANK", "1")  # said once, by rank 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _Heart()


def test_prepare_sets_defaults_user_values_win(tmp_path, monkeypatch):
    for k in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TRAINGUARD_FAULT", "TRAINGUARD_HANG_TIMEOUT",
              "TRAINGUARD_DEAD_AFTER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare() writes the agent's environment
    args = build_parser().parse_args(["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                      "127.0.0.1:1", "--rdzv-conf", "last_call_timeout=7", "--run-dir",
                                      str(tmp_path), "--fault", "step=2,rank=1,kind=hang",
                                      "--hang-timeout", "4", "x.py"])
    prepare(args)
    conf = dict(kv.split("=") for kv in args.rdzv_conf.split(","))
    assert conf == {"last_call_timeout": "7", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert os.environ["TRAINGUARD_FAULT"] == "step=2,rank=1,kind=hang"
    assert os.environ["TRAINGUARD_HANG_TIMEOUT"] == "4.0" and args.max_restarts == 3
    assert os.environ["TRAINGUARD_DEAD_AFTER"] == "3.0" and args.monitor_interval == 0.1


def test_agent_logs_failures_without_importing_dynamo():
    # torch's log formatter imports torch._dynamo (~2 s) for a record with a traceback; the agent
    # logs every worker failure that way. With trainguard's filter the traceback is still logged.
    code = """if True:
        import logging, sys
        import torch
        from trainguard.elastic.launcher import install_log_filter
        log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        install_log_filter()
        assert "torch._dynamo" not in sys.modules
        try:
            raise ValueError("worker died")
        except ValueError:
            log.exception("failed (exitcode: 1)")
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "no dynamo"
    assert "failed (exitcode: 1)" in p.stderr and "ValueError: worker died" in p.stderr


def test_auto_timeout_follows_step_times():
    w = Watchdog(floor=5.0, factor=10.0)
    assert w.current_timeout() == 5.0
    w._gaps.extend([0.1, 2.0, 0.1])
    assert w.current_timeout() == 20.0
    assert Watchdog(timeout=3.0).current_timeout() == 3.0


@pytest.mark.timeout(180)
def _exit_with(index: int, codes: tuple[int, ...]) -> None:
    os._exit(codes[index])


def test_the_worker_trainguard_ended_is_the_cause_even_when_a_peer_is_found_first():
    """Rank 1's watchdog ends it (75), then rank 0 fails in its broken collective (1); the agent
    looks once both are gone. torch's join reports the first failed process in index order
    (rank 0, "exit code 1"); the agent's hook reports rank 1's hang."""
    import multiprocessing.connection

    import torch.multiprocessing as tmp
    from torch.multiprocessing.spawn import ProcessException

    pc = tmp.start_processes(_exit_with, args=((1, HANG_EXIT),), nprocs=2, join=False, start_method="fork")
    try:
        pending = [p.sentinel for p in pc.processes]
        while pending:  # both gone before anyone looks; bounded
            ready = multiprocessing.connection.wait(pending, timeout=30)
            assert ready, "workers did not exit"
            pending = [s for s in pending if s not in ready]
        with pytest.raises(ProcessException) as raised:
            pc.join(1)
        cause = root_failure(pc, raised.value)
        assert (cause.error_index, cause.exit_code) == (1, HANG_EXIT)
        assert root_failure(pc, cause) is cause
    finally:
        for p in pc.processes:
            p.join(5)


def test_hang_is_detected_stacks_logged_and_job_restarts(tmp_path):
    run_dir = tmp_path / "run"
    train = os.path.join(os.path.dirname(__import__("trainguard.demo.train").demo.train.__file__), "train.py")
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           "--start-method", "fork", "--run-path", "--run-dir", str(run_dir), "--hang-timeout", "4",
           "--fault", "step=12,rank=1,kind=hang", train, "--steps", "20", "--save-every", "5", "--size", "tiny"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:  # pragma: no cover - reported with its output
        pytest.fail(f"trainguard run did not finish: {e.stderr}")
    assert p.returncode == 0, p.stderr[-3000:]
    events = list(read_events(run_dir))
    hangs = [e for e in events if e["event"] == "hang"]
    assert hangs and any("_injected_hang" in e["stacks"] for e in hangs), json.dumps(hangs)[:2000]
    assert "_injected_hang" in p.stderr and "no progress for" in p.stderr
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1 and "hang" in failures[0]["cause"]
    restores = [e for e in events if e["event"] == "restore" and e["rank"] == 0]
    assert [e["step"] for e in restores] == [10]
    assert max(e["step"] for e in events if e["event"] == "step") == 20
    assert list(run_dir.glob("hang-rank1-*.txt"))
