"""Session 55's new-user review of the installed `trainguard` command (review55e): a wheel built from
the tree, installed in a fresh venv, README and docs followed from a directory outside the repo. Each
test runs the command on real files, in a process of its own (the CLI as a user runs it), and fails
on the code before its fix: an error line that sent the user the wrong way or named nothing to change."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import trainguard as tg

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path, other_user: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m trainguard ARGS`` in ``cwd``; ``other_user``: as a user that may not write where the
    test made a read-only directory (root may write anywhere: the command then runs as nobody)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "HOME": str(cwd)}
    cmd = [sys.executable, "-m", "trainguard", *args]
    if other_user and os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter, holding a read-only directory ``ro`` and a run directory
    ``run`` with one checkpoint; removed after. Made in /tmp itself: pytest's tmp_path and this suite's
    own temp directory (conftest) are root's alone (mode 700), where the library's absolute paths
    stopped the other user before the directory under test did."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user that a read-only directory stops")
    d = Path(tempfile.mkdtemp(prefix="tg-review55e-", dir="/tmp"))
    try:
        d.chmod(0o755)
        tg.save(d / "run" / "step-000000001", {"model": torch.nn.Linear(2, 2)})
        for p in d.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (d / "ro").mkdir(mode=0o555)
        (d / "ro").chmod(0o555)
        probe = _cli("--version", cwd=d, other_user=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot run the command as another user here: {probe.stderr[-300:]}")
        yield d
    finally:
        (d / "ro").chmod(0o755) if (d / "ro").exists() else None
        shutil.rmtree(d, ignore_errors=True)


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_convert_of_a_missing_source_says_it_is_not_there(tmp_path: Path) -> None:
    """Before: "nodir: not a trainguard checkpoint (no manifest.json), DCP directory (no .metadata), ...;
    pass the source format explicitly (--from)": a typo in the path sent the user after a format flag."""
    line = _one_error(_cli("convert", "no_such_ckpt", "out.safetensors", cwd=tmp_path))
    assert "no_such_ckpt: no such file or directory" in line, line
    assert "--from" not in line, line
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_of_a_run_directory_names_its_steps(tmp_path: Path) -> None:
    """Before: a run directory (what `trainguard ls` takes) given to convert was "not a trainguard
    checkpoint ... pass the source format explicitly (--from)"; inspect/export/consolidate said what it is."""
    tg.save(tmp_path / "run" / "step-000000003", {"model": torch.nn.Linear(2, 2)})
    line = _one_error(_cli("convert", "run", "out.safetensors", cwd=tmp_path))
    assert "is a run directory, not one checkpoint" in line and "trainguard ls" in line, line
    assert "--from" not in line, line
    # the step directory it points to converts
    ok = _cli("convert", "run/step-000000003", "out.safetensors", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "out.safetensors").is_file()


def test_a_url_whose_server_cannot_be_reached_is_named(tmp_path: Path) -> None:
    """fsspec's ftp:// filesystem connects when it is made: a refused connection (or a host name that
    does not resolve) was "error: [Errno 111] Connection refused" / "error: Name or service not known",
    naming neither the URL nor what to change."""
    pytest.importorskip("fsspec")
    with socket.socket() as s:  # a local port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"ftp://127.0.0.1:{port}/run"
    for cmd in (["ls", url], ["verify", url], ["inspect", f"{url}/step-000000001"]):
        line = _one_error(_cli(*cmd, cwd=tmp_path))
        assert url in line and "check the host name" in line, (cmd, line)


def test_plan_plot_into_a_read_only_directory(shared_dir: Path) -> None:
    """Before: "error: ro/p.png: Permission denied (run the command as the user that wrote the
    checkpoints, or give this one read access)": plan reads no checkpoint, and read access was not it."""
    args = ["plan", "--save-stall", "30s", "--restart", "10m", "--node-failures-per-day", "0.01"]
    line = _one_error(_cli(*args, "--plot", "ro/p.png", cwd=shared_dir, other_user=True))
    assert "--plot ro/p.png" in line and "may not write" in line, line
    assert "read access" not in line and "wrote the checkpoints" not in line, line
    missing = _one_error(_cli(*args, "--plot", "nodir/p.png", cwd=shared_dir))
    assert "does not exist; create it first" in missing, missing  # before: "nodir/p.png: No such file or directory"


def test_report_plot_into_a_read_only_directory_fails_before_the_summary(shared_dir: Path) -> None:
    """Before: the summary was printed, then the same read-access advice as for plan, exit 2."""
    (shared_dir / "events.jsonl").write_text(json.dumps({"t": 1.0e9, "event": "save", "step": 1}) + "\n")
    (shared_dir / "events.jsonl").chmod(0o644)
    r = _cli("report", ".", "--plot", "ro/r.png", cwd=shared_dir, other_user=True)
    line = _one_error(r)
    assert "--plot ro/r.png" in line and "may not write" in line, line
    assert "read access" not in line, line
    assert r.stdout == "", r.stdout


@pytest.mark.parametrize("out", ["ro/m.pt", "ro/m.safetensors"])
def test_convert_and_export_into_a_read_only_directory(shared_dir: Path, out: str) -> None:
    """Before, convert to .pt: "cannot write ro/m.pt: RuntimeError: [enforce fail at inline_container.cc:747] .
    open file failed with strerror: Permission denied" (torch.save's words); to .safetensors a
    PermissionError on a temporary file's name. Now both say which directory and what to change."""
    for cmd in (["convert", "run/step-000000001", out], ["export", "run/step-000000001", "--to", out]):
        line = _one_error(_cli(*cmd, cwd=shared_dir, other_user=True))
        assert "may not write in" in line and "enforce fail" not in line and ".tmp-" not in line, (cmd, line)
    assert os.listdir(shared_dir / "ro") == []


def test_import_and_consolidate_into_a_read_only_directory(shared_dir: Path) -> None:
    """Before: "save of .../ro/imp failed: PermissionError: [Errno 13] Permission denied: '.../ro/imp.tmp-<id>'"
    and "consolidate ... failed: PermissionError: ... 'ro/c2.tmp-<id>'": a temporary name, nothing to change."""
    torch.save({"weight": torch.ones(2, 2)}, shared_dir / "w.pt")
    (shared_dir / "w.pt").chmod(0o644)
    for cmd in (["convert", "w.pt", "ro/imp"], ["consolidate", "run/step-000000001", "ro/c2"]):
        line = _one_error(_cli(*cmd, cwd=shared_dir, other_user=True))
        assert f"this user may not write in {shared_dir / 'ro'}" in line and ".tmp-" not in line, (cmd, line)
    assert os.listdir(shared_dir / "ro") == []


def test_plan_shows_a_small_job_s_lost_gpu_hours(tmp_path: Path) -> None:
    """Before: one node of 8 GPUs failing every 400 days, saving at the optimum (99.87% efficient),
    loses 0.256 GPU-hours a day, and the table said "0" in every row, as if nothing were lost."""
    r = _cli("plan", "--save-stall", "30s", "--restart", "10m", "--node-mtbf", "400d", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cells = [ln.split("│")[-2].strip() for ln in r.stdout.splitlines() if "99.87%" in ln]
    assert cells == ["0.256"] * 3, r.stdout
    big = _cli("plan", "--nodes", "256", "--node-failures-per-day", "0.0065", "--save-stall", "30s", "--restart", "10m",
               cwd=tmp_path)
    assert "2,198" in big.stdout, big.stdout  # 100 and more: whole hours, with thousands separators, as before


def test_run_dir_that_exists_but_is_read_only(shared_dir: Path) -> None:
    """Before: `trainguard run --run-dir ro` of an existing directory this user may not write was
    "--run-dir ro: cannot create the directory (Permission denied)": it is there; writing in it is what fails."""
    (shared_dir / "train.py").write_text("")
    (shared_dir / "train.py").chmod(0o644)
    line = _one_error(_cli("run", "--nproc-per-node", "1", "--run-dir", "ro", "train.py", cwd=shared_dir, other_user=True))
    assert "--run-dir ro: cannot write in the directory" in line and "write access" in line, line


def test_a_step_that_is_not_there_names_the_steps_that_are(tmp_path: Path) -> None:
    """Before: `trainguard inspect run/step-000000099` (or export, consolidate, a step mistyped a digit
    short) said "no such checkpoint directory" and nothing of the steps the run holds; convert told
    the user to pass --from."""
    for step in (3, 7):
        tg.save(tmp_path / "run" / f"step-{step:09d}", {"model": torch.nn.Linear(2, 2)})
    want = "holds step(s) 7, 3: `trainguard ls"
    for cmd in (["inspect", "run/step-000000099"], ["inspect", "run/step-00000007"],
                ["export", "run/step-000000099", "--to", "w.pt"], ["consolidate", "run/step-000000099", "out"],
                ["convert", "run/step-000000099", "w.safetensors"]):
        line = _one_error(_cli(*cmd, cwd=tmp_path))
        assert want in line and "--from" not in line, (cmd, line)
    with pytest.raises(tg.CheckpointError, match=r"holds step\(s\) 7, 3"):
        tg.load(tmp_path / "run" / "step-000000005", {"model": torch.nn.Linear(2, 2)})
