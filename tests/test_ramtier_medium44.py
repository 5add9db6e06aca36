"""``ram_tier=`` on a directory that is not tmpfs is warned about at ``open`` (before, any
directory was taken without a word): on a disk every save is written to disk twice; on ramfs,
which reports 0 bytes free, every save went straight to the run directory, the RAM tier unused."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.doctor import filesystem_of, parse_mountinfo


def _fs(path: Path) -> str | None:
    return filesystem_of(os.path.realpath(path), parse_mountinfo(Path("/proc/self/mountinfo").read_text()))


def _open_and_save(root: Path, base: Path) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False) as mgr:
            mgr.save(1, {"progress": tg.StateDict(step=1)})
    return [str(w.message) for w in seen if str(w.message).startswith("ram_tier: ")]


def test_a_ram_tier_on_a_disk_is_warned_about_naming_the_filesystem(tmp_path: Path) -> None:
    base = tmp_path / "notram"
    base.mkdir()
    fs = _fs(base)
    if fs in (None, "tmpfs"):
        pytest.skip(f"{tmp_path} is on {fs}")
    (msg,) = _open_and_save(tmp_path / "run", base)
    assert f"is on {fs}, not tmpfs" in msg and "ram_tier=True" in msg, msg
    assert (tmp_path / "run" / "step-000000001" / "manifest.json").exists()  # a warning, the saves go on


def test_a_ram_tier_on_tmpfs_is_not_warned_about(tmp_path: Path) -> None:
    if _fs(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    base = Path(tempfile.mkdtemp(prefix="tg-medium-", dir="/dev/shm"))
    try:
        assert _open_and_save(tmp_path / "run", base) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_ram_tier_on_ramfs_says_every_save_would_go_to_disk(tmp_path: Path) -> None:
    base = tmp_path / "ramfs"
    base.mkdir()
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(base)],
                                          capture_output=True, timeout=60).returncode:
        pytest.skip("cannot mount a ramfs here")
    try:
        assert shutil.disk_usage(base).free == 0  # what made every save skip it
        (msg,) = _open_and_save(tmp_path / "run", base)
        assert "is on ramfs" in msg and "0 bytes free" in msg and str(tmp_path / "run") in msg, msg
    finally:
        subprocess.run(["umount", "-l", str(base)], capture_output=True, timeout=60)
