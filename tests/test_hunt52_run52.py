"""Session-52 hunt of ``trainguard run`` and ``trainguard report`` (run52).

Real ``trainguard run`` jobs (2 gloo ranks on 127.0.0.1, a fault drill), their temp directory private to
the test (``TMPDIR``); logs written as ``EventLog`` writes them. Every child is bounded by a timeout and
killed by its pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.events import read_events

# A worker: 2 gloo ranks, an all-reduce a step (a peer's death fails it), a sync save every 2 steps.
WORKER = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    import trainguard as tg
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(8), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(2), async_save=False) as mgr:
        step = mgr.restore(state) or 0
        while step < 6:
            step += 1
            t = torch.ones(1)
            dist.all_reduce(t)
            state["w"].add_(t)
            state["progress"]["step"] = step
            mgr.save(step, state)
    dist.destroy_process_group()
""")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> tuple[int, str]:
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = p.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["run-path", "script"])
def test_a_failed_worker_leaves_no_error_file_in_the_temp_directory(tmp_path: Path, workers: str) -> None:
    """Rank 1 raises at step 3 (``--fault kind=exception``), rank 0 then fails in its all-reduce; the agent
    restarts both, which finish. Before, torch left in ``TMPDIR`` one ``pytorch-errorfile-*.pickle`` (~2 KB)
    per raising function worker (``--run-path``: 2 here) and, without ``--log-dir``, a ``torchelastic_*``
    directory (both kinds of worker). Now nothing is left there, and the worker's traceback still reaches
    the agent's output (``--run-path``: that of rank 1, which raised first, not only rank 0's gloo error;
    before, rank 1 was named "exit code 1" alone) and its ``error.json`` under ``<run dir>/.trainguard/logs``."""
    tmp, run_dir, script = tmp_path / "tmp", tmp_path / "run", tmp_path / "train.py"
    tmp.mkdir()
    script.write_text(WORKER)
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--run-dir", str(run_dir), "--fault", "step=3,rank=1,kind=exception"]
    cmd += ["--start-method", "fork", "--run-path", str(script)] if workers == "run-path" else [str(script)]
    rc, out = _run(cmd, env)
    assert rc == 0, out[-4000:]
    events = list(read_events(run_dir))
    assert [e["rank"] for e in events if e["event"] == "failure"] == [1], events
    assert max(e["step"] for e in events if e["event"] == "step") == 6
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("pytorch-errorfile-", "torchelastic_")))
    assert left == [], left
    assert "InjectedFault: injected fault: step=3,rank=1,kind=exception" in out, out[-4000:]  # the agent logged it
    logs = run_dir / ".trainguard" / "logs"
    assert logs.is_dir()  # torch's log directory for this agent (a script worker writes no error.json without @record)
    if workers == "run-path":  # torch's own wrapper of the worker's function records it
        errors = [json.loads(p.read_text()) for p in logs.rglob("error.json")]
        assert any("InjectedFault" in e["message"]["message"] for e in errors), errors


def test_a_given_log_dir_is_kept(tmp_path: Path) -> None:
    """``--log-dir`` given: torch's agent uses it, as before (the default applies only without one)."""
    from trainguard.elastic import errfiles
    from trainguard.elastic.launcher import build_parser, prepare

    for given, want in ((["--log-dir", str(tmp_path / "mine")], str(tmp_path / "mine")),
                        ([], str(tmp_path / "run" / ".trainguard" / "logs"))):
        args = build_parser().parse_args(["--run-dir", str(tmp_path / "run"), *given, "train.py"])
        prepare(args)
        assert args.log_dir == want and errfiles.LOG_SUBDIR == os.path.join(".trainguard", "logs")


def _raise_in_order(index: int, stop_file: str) -> None:
    """Process 1 raises first; process 0 raises once process 1 noted its raise (a peer failing in its
    collective after the cause): both write torch's error file and exit 1."""
    import glob
    import time

    from trainguard.elastic import stops

    if index == 0:
        end = time.monotonic() + 30
        while not glob.glob(f"{stop_file}.raised-*") and time.monotonic() < end:  # bounded
            time.sleep(0.01)
    stops.note_raised()
    raise RuntimeError("rank 1's own error" if index else "Connection closed by peer")


@pytest.mark.timeout(120)
def test_the_first_to_raise_is_reported_with_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both function workers raise, rank 1 first; torch's ``join`` reports rank 0 (first in process order) with
    its traceback, the agent's hook names rank 1 (``root_failure``). It said "process 1 terminated with exit
    code 1" without rank 1's traceback, which torch had in rank 1's error file: the agent's output showed rank 0's
    consequence and not the cause. The error files are removed once the context is done (``errfiles.drop``)."""
    import multiprocessing.connection
    import tempfile

    import torch.multiprocessing as tmp
    from torch.multiprocessing.spawn import ProcessException, ProcessRaisedException

    from trainguard.elastic import errfiles, stops

    stop_file = str(tmp_path / "stopped")
    monkeypatch.setenv(stops.STOP_FILE_ENV, stop_file)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # torch names the error files there
    pc = tmp.start_processes(_raise_in_order, args=(stop_file,), nprocs=2, join=False, start_method="fork")
    try:
        pending = [p.sentinel for p in pc.processes]
        while pending:  # both gone before anyone looks; bounded
            ready = multiprocessing.connection.wait(pending, timeout=30)
            assert ready, "workers did not exit"
            pending = [s for s in pending if s not in ready]
        with pytest.raises(ProcessException) as raised:
            pc.join(1)
        assert raised.value.error_index == 0 and "Connection closed by peer" in str(raised.value)
        cause = stops.root_failure(pc, raised.value)
        assert isinstance(cause, ProcessRaisedException) and cause.error_index == 1, cause
        assert "RuntimeError: rank 1's own error" in str(cause), str(cause)
        assert sorted(p.name for p in tmp_path.glob("pytorch-errorfile-*")) != []
        errfiles.drop(pc)
        assert list(tmp_path.glob("pytorch-errorfile-*")) == []
    finally:
        for p in pc.processes:
            p.join(5)
