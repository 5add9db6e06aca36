"""trainguard as a user installs it: the wheel and sdist built from this tree, and the CLI with
the declared dependencies only (session 47).

Seen in a fresh venv with torch==2.13.0 and the wheel (no dev extra): ``trainguard demo`` trained
both runs, printed its table, then ended in ``ModuleNotFoundError: No module named 'matplotlib'``
(exit 1) drawing its default timeline; with click 8.1.0 (``click>=8.1`` allows it) every
``trainguard`` command that exited through click (``--help``, ``--version``, a usage error) raised
``AttributeError: module 'click.exceptions' has no attribute 'NoArgsIsHelpError'``; the wheel and
sdist held no license text for their Apache-2.0, and the sdist held tests/test_*.py without the
conftest.py and helpers they import.

matplotlib is made unimportable here by a ``sys.meta_path`` finder in the child, and click 8.1's
missing class by deleting it from ``click.exceptions`` before trainguard is imported: what the
child sees is what an install without them sees.
"""

from __future__ import annotations

import email
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NO_MATPLOTLIB = """\
import sys

class _NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoMatplotlib())
from trainguard.cli import main
main(prog_name="trainguard")
"""

CLICK_81 = """\
import click.exceptions
del click.exceptions.NoArgsIsHelpError  # click 8.1 has no such class
from trainguard.cli import main
main(prog_name="trainguard")
"""


def _cli(code: str, *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` on this tree's trainguard (bounded in time; killed on timeout)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if cwd is not None:
        env["TMPDIR"] = str(cwd)  # the demo's run directories
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _tree(tmp_path: Path) -> Path:
    """What a build reads, copied: a build in the checkout leaves build/ and *.egg-info in it."""
    src = tmp_path / "tree"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for d in ("tests", "bench", "docs", "examples"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", ".tmp", "results"))
    for f in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "SECURITY.md", "Makefile"):
        if (ROOT / f).exists():
            shutil.copy(ROOT / f, src / f)
    return src


@pytest.mark.slow  # a whole demo run; the demo itself is in make test (test_demo.py): `make test-slow` (suite time)
def test_demo_without_matplotlib_runs_to_its_verdict_and_leaves_the_default_timeline_out(tmp_path):
    p = _cli(NO_MATPLOTLIB, "demo", "--size", "tiny", "--steps", "6", "--fault-step", "3", "--save-every", "2",
             cwd=tmp_path, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "final weights bit-identical: YES" in p.stdout
    assert "matplotlib is not installed" in p.stdout and "pip install matplotlib" in p.stdout
    left = [f.name for f in tmp_path.iterdir() if f.name.endswith(".png") or f.name.startswith("trainguard")]
    assert left == []  # no timeline written (the cwd), the demo's run directories removed (TMPDIR)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc): the demo's agent and the agent's workers."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_demo_terminated_stops_its_runs_and_removes_their_directories(tmp_path):
    """``kill PID`` of the demo (SIGTERM: ``timeout``, a scheduler's stop) ended the demo alone: its
    ``trainguard run`` agent and the agent's 2 workers trained on (parent 1), and the demo's
    temporary directory stayed. Now the agent is sent SIGTERM (it stops its workers), the
    directory is removed and the demo exits 143."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path))
    demo = subprocess.Popen([sys.executable, "-m", "trainguard", "demo", "--size", "tiny", "--steps", "100000",
                             "--fault-step", "99999", "--save-every", "1000", "--plot", ""],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while not any("step 100 loss" in f.read_text(errors="replace") for f in tmp_path.glob("trainguard-demo-*/kill.log")):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's kill run did not reach step 100"
            time.sleep(0.05)
        below = _descendants(demo.pid)
        assert len(below) >= 3  # the agent and its 2 workers
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=180)
        assert demo.returncode == 143, err[-3000:]
        assert "terminated: the demo's runs were stopped and their directories removed" in err
        assert [p for p in below if _alive(p)] == []
        assert list(tmp_path.glob("trainguard-demo-*")) == []
    finally:
        _end(demo, below)


def _end(demo: subprocess.Popen, below: set[int]) -> None:
    """SIGKILL what is left of a demo and the processes found below it (a failure before the scan: found now)."""
    below |= _descendants(demo.pid) if demo.poll() is None else set()
    for pid in [demo.pid, *below]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    demo.wait(timeout=60)


def test_demo_training_saves_no_values_that_differ_between_ranks(tmp_path):
    """The demo's worker script saved each rank's own loss in its shared ``progress`` entry: every
    save of its runs warned SharedValuesDifferWarning ("the checkpoint keeps rank 0's") in the
    logs the demo keeps (``--keep``) or shows when a run fails."""
    train = ROOT / "src" / "trainguard" / "demo" / "train.py"
    p = _cli("from trainguard.cli import main; main()", "run", "--nproc-per-node", "2", "--run-dir",
             str(tmp_path / "run"), str(train), "--steps", "4", "--save-every", "2", "--size", "tiny",
             "--corpus-bytes", "20000", cwd=tmp_path, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "SharedValuesDifferWarning" not in out and "differ between ranks" not in out, out[-3000:]
    assert sorted(d.name for d in (tmp_path / "run").glob("step-*")) == ["step-000000002", "step-000000004"]


def test_demo_plot_asked_for_without_matplotlib_is_refused_before_training(tmp_path):
    p = _cli(NO_MATPLOTLIB, "demo", "--size", "tiny", "--steps", "6", "--fault-step", "3",
             "--plot", str(tmp_path / "t.png"), cwd=tmp_path, timeout=240)
    assert p.returncode == 2, (p.stdout + p.stderr)[-3000:]
    assert p.stderr.strip() == "error: --plot needs matplotlib: pip install matplotlib"
    assert "trainguard run" not in p.stdout  # no run started


@pytest.mark.parametrize("args,code,says", [
    (["--help"], 0, "Commands:"),
    (["--version"], 0, "version"),
    (["--bogus"], 2, "error: No such option"),
    (["export", "x"], 2, "error: Missing option '--to'"),
])
def test_cli_exits_through_click_81(args, code, says):
    p = _cli(CLICK_81, *args)
    assert p.returncode == code and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert says in p.stdout + p.stderr


def test_wheel_holds_the_license_and_every_package_and_no_tests(tmp_path):
    tree = _tree(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(tree)], check=True, timeout=120, capture_output=True)
    (whl,) = (tmp_path / "dist").glob("trainguard-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{info}/licenses/LICENSE" in names
    assert "Apache License" in zipfile.ZipFile(whl).read(f"{info}/licenses/LICENSE").decode()
    packages = {str(p.parent.relative_to(ROOT / "src")) for p in (ROOT / "src/trainguard").rglob("__init__.py")}
    assert {"trainguard", "trainguard/commands", "trainguard/demo", "trainguard/elastic", "trainguard/storage"} <= packages
    for pkg in packages:
        assert f"{pkg}/__init__.py" in names, pkg
    assert "trainguard/py.typed" in names
    assert not [n for n in names if n.split("/")[0] in ("tests", "bench", "examples", "docs")]
    meta = email.message_from_bytes(zipfile.ZipFile(whl).read(f"{info}/METADATA"))
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"


def test_sdist_holds_the_license_docs_and_examples_and_no_half_test_suite(tmp_path):
    tree = _tree(tmp_path)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, check=True, timeout=120, capture_output=True,
                       text=True)
    with tarfile.open(tmp_path / "dist" / p.stdout.strip().splitlines()[-1]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "src/trainguard/py.typed", "docs/storage.md",
            "examples/plain_loop.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))], sorted(names)[:5]
