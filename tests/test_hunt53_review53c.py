"""Session 53 hunt (review53c): review of the agent53 merge (d3bd240): the error file a worker's excepthook
writes (``permanent._record``), with real worker processes and a real ``trainguard run`` agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainguard as tg

SRC = str(Path(tg.__file__).resolve().parent.parent)

# A rank whose helper process (it inherits the rank's environment) imports trainguard and fails; the rank
# goes on, then fails with its own error.
RANK_WITH_FAILING_HELPER = """\
    import subprocess, sys
    import trainguard
    helper = subprocess.run([sys.executable, "-c", "import trainguard; raise ValueError('the helper failed')"],
                            timeout=60)
    assert helper.returncode == 1
    raise RuntimeError("the rank's own failure")
"""

# An exception whose str() raises; permanent when argv[1] says so.
BROKEN_STR = """\
    import sys
    import trainguard
    from trainguard.permanent import mark

    class Broken(Exception):
        def __str__(self):
            raise ValueError("no str")

    e = Broken()
    raise mark(e) if sys.argv[1] == "permanent" else e
"""


def _worker(tmp_path: Path, code: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``code`` as a worker of an agent (its TRAINGUARD_AGENT_PID another process; its error file set)."""
    script, err = tmp_path / "w.py", tmp_path / "error.json"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": SRC, "TRAINGUARD_AGENT_PID": str(os.getpid()),
           "TORCHELASTIC_ERROR_FILE": str(err)}
    env.pop("TRAINGUARD_ERROR_FILE_OWNER", None)
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=90)
    return proc, err


def test_helper_process_does_not_write_the_ranks_error_file(tmp_path: Path) -> None:
    """d3bd240: the helper's excepthook wrote the rank's error file (it inherits TORCHELASTIC_ERROR_FILE), and
    the rank's own error was then not written (the file existed): the agent reported the helper's error."""
    proc, err = _worker(tmp_path, RANK_WITH_FAILING_HELPER)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(err.read_text())
    assert data["message"]["message"] == "RuntimeError: the rank's own failure"
    assert "the helper failed" not in data["message"]["extraInfo"]["py_callstack"]


@pytest.mark.parametrize("kind,code", [("plain", 1), ("permanent", tg.PERMANENT_EXIT)])
def test_exception_whose_str_raises(tmp_path: Path, kind: str, code: int) -> None:
    """d3bd240: ``_record`` formatted ``str(e)`` outside its guard: "Error in sys.excepthook", no error file;
    a permanent one (``say``'s ``str(e)``) exited 1 and was restarted, not 78."""
    proc, err = _worker(tmp_path, BROKEN_STR, kind)
    assert proc.returncode == code, proc.stderr
    assert "Error in sys.excepthook" not in proc.stderr, proc.stderr
    data = json.loads(err.read_text())
    assert data["message"]["message"] == "Broken: <exception str() failed>"
    assert "raise mark(e) if" in data["message"]["extraInfo"]["py_callstack"]


@pytest.mark.slow
def test_agent_failure_event_has_the_ranks_traceback(tmp_path: Path) -> None:
    """A real ``trainguard run`` agent: the ``failure`` event's traceback is the rank's, not its helper's."""
    script, run_dir = tmp_path / "w.py", tmp_path / "run"
    script.write_text(textwrap.dedent(RANK_WITH_FAILING_HELPER))
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("TRAINGUARD_ERROR_FILE_OWNER", None)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--nproc-per-node", "1", "--max-restarts", "0",
                           "--monitor-interval", "0.1", "--run-dir", str(run_dir), str(script)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (failure,) = [e for e in events if e.get("event", e.get("kind")) == "failure"]
    assert "the rank's own failure" in failure["traceback"]
    assert "the helper failed" not in failure["traceback"]
