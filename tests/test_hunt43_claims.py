"""Claims of docs/planning.md checked against `trainguard doctor` (hunt 43, "claims").

"A script the doctor cannot use (..., one that exits or raises while imported, a hook that raises
...) is a one-line `error:` with exit code 2, so a CI step tells it from a finding that is an
error (1)." A hook that called ``sys.exit(0)`` ended the doctor with 0 and printed nothing (a CI
step passed a script that was never checked), ``sys.exit("msg")`` with 1; a script that called
``os._exit(0)`` while imported ended it with 0 too. Run in a subprocess: ``os._exit`` would end
the test process itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

SCRIPTS = {
    "hook_exit0": """
        import sys

        def trainguard_state():
            sys.exit(0)
        """,
    "hook_exit_message": """
        import sys

        def trainguard_state():
            sys.exit("config.yaml not found")
        """,
    "import_os_exit0": """
        import os

        def trainguard_state():
            return {}

        os._exit(0)
        """,
}


def _doctor(script: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "trainguard", "doctor", str(script)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_doctor_script_that_exits_is_a_usage_error(tmp_path: Path, name: str) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(SCRIPTS[name]))
    res = _doctor(script)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "exit" in last, res.stderr
    assert res.stdout == ""  # no findings table: the state was never checked


def test_doctor_hook_that_forks_a_child_still_works(tmp_path: Path) -> None:
    """os._exit stays os._exit in a child the hook forks (multiprocessing ends its children with it)."""
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp

        import torch

        def work(q):
            q.put(42)

        def trainguard_state():
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=work, args=(q,))
            p.start()
            got = q.get(timeout=60)
            p.join(60)
            assert p.exitcode == 0 and got == 42, (p.exitcode, got)
            return {"model": torch.nn.Linear(2, 2)}
        """))
    res = _doctor(script)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)  # a finding that is an error: data position
    assert "data position" in res.stdout and "model weights saved" in res.stdout


def test_a_malformed_store_timeout_is_one_error_line_exit_2(tmp_path: Path) -> None:
    """docs/checkpoints.md: errors caused by input print one `error:` line and exit 2. A malformed
    TRAINGUARD_STORE_TIMEOUT (docs/storage.md) gave a traceback of its ValueError and exit 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               TRAINGUARD_STORE_TIMEOUT="abc")
    res = subprocess.run([sys.executable, "-m", "trainguard", "ls", "memory://hunt43-claims"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.strip().splitlines() == [
        "error: TRAINGUARD_STORE_TIMEOUT='abc': set it to the seconds one object-store call may take "
        "(a number > 0; default 600)"], res.stderr


def test_a_malformed_store_timeout_is_still_a_value_error_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.storage import for_path

    monkeypatch.setenv("TRAINGUARD_STORE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="TRAINGUARD_STORE_TIMEOUT='0'"):
        for_path("memory://hunt43-claims")


@pytest.mark.parametrize("url", ["s3://", "s3:///run1"])
def test_an_s3_url_without_a_bucket_is_one_error_line_exit_2(url: str) -> None:
    """`trainguard ls s3://` (or `s3:///run1`) printed s3fs's traceback, "ValueError: Cannot traverse all
    of S3", and exited 1; an input error is one `error:` line with exit 2 (docs/checkpoints.md)."""
    pytest.importorskip("s3fs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "trainguard", "ls", url], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.strip().splitlines() == [f"error: {url}: names no bucket; write s3://<bucket>/<run directory>"]


def test_a_bucket_url_is_still_fine() -> None:
    pytest.importorskip("s3fs")
    from trainguard.errors import CheckpointError
    from trainguard.storage import for_path

    with pytest.raises(CheckpointError, match="names no bucket"):
        for_path("s3:///run1")
    _storage, path = for_path("s3://bucket/run1")
    assert path == "bucket/run1"
