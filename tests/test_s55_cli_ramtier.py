"""``trainguard ls``/``verify`` with a ``--ram-tier`` directory that does not exist (a typo) say so, exit 2;
before, they listed no RAM copies without a word, as if this node held none (review55e)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import trainguard as tg


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "run"
    with tg.CheckpointManager(str(root), save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    return root


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_a_ram_tier_directory_that_does_not_exist_is_refused(run, tmp_path, command):
    missing = tmp_path / "no-such-shm"
    r = _cli(command, str(run), "--ram-tier", str(missing))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "--ram-tier" in r.stderr and f"{missing}: no such directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_an_existing_ram_tier_directory_and_the_default_are_taken(run, tmp_path, command):
    empty = tmp_path / "shm"
    empty.mkdir()
    for extra in (["--ram-tier", str(empty)], []):
        r = _cli(command, str(run), *extra)
        assert r.returncode == 0, (extra, r.stdout, r.stderr)
