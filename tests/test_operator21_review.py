"""Review (session 21, operator): what an operator does to a run directory by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import trainguard as tg
from trainguard.permanent import is_permanent

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

_CHILD = r"""
import os, sys, torch, trainguard as tg
from trainguard.permanent import is_permanent
root = sys.argv[1]
try:
    open(os.path.join(root, "probe"), "w")
    print("WRITABLE"); sys.exit(0)
except PermissionError:
    pass
st = {"w": torch.zeros(4)}
try:
    with tg.CheckpointManager(root) as m:
        m.restore(st)
    print("OPENED")
except tg.CheckpointError as e:
    print("ERROR", is_permanent(e), e)
st = {"w": torch.zeros(4)}
tg.load(os.path.join(root, "step-000000002"), st)  # the way the error names: no write
print("LOADED", st["w"].tolist())
"""


def _read_only_run(cmd: list[str]) -> list[str]:
    """Run the child in ``cmd``'s process: as root, with the capabilities that ignore permissions dropped."""
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a chmod'ed directory stays writable")
    caps = "-dac_override,-dac_read_search,-fowner"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", *cmd]


def test_read_only_copy_error_says_how_to_read_it(tmp_path) -> None:
    """A run directory copied with cp -r and made read-only (chmod -R a-w): the manager cannot open it
    (it writes its .lock). The error said only "fix the storage or its permissions"; now it names the
    read-only way (trainguard.load of one step, `trainguard ls` to list them), which works, and is
    permanent (a restart under `trainguard run` cannot make the copy writable)."""
    run = tmp_path / "run ü"
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1)) as m:
        for s in (1, 2):
            state["w"].fill_(s)
            m.save(s, state)
    copy = tmp_path / "copy ü"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    subprocess.run(["chmod", "-R", "a-w", str(copy)], check=True)
    try:
        cmd = _read_only_run([sys.executable, "-c", _CHILD, str(copy)])
        env = {**os.environ, "PYTHONPATH": _SRC}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(copy)], check=True)
    assert r.returncode == 0, r.stderr
    if "WRITABLE" in r.stdout:
        pytest.skip("chmod -R a-w does not stop writes here")
    err = next(line for line in r.stdout.splitlines() if line.startswith("ERROR"))
    assert err.startswith("ERROR True "), err
    assert "trainguard.load(" in err and "step-N" in err and "trainguard ls" in err, err
    assert "LOADED [2.0, 2.0, 2.0, 2.0]" in r.stdout
    assert sorted(os.listdir(copy)) == sorted(os.listdir(run))  # nothing written to or removed from the copy


def test_read_only_mount_is_permanent() -> None:
    """EROFS (a read-only mount) is an OSError but no PermissionError: it was a transient error
    (a restart loop under `trainguard run`) with the generic message."""
    from trainguard.permanent import open_error

    e = OSError(30, "Read-only file system", "/mnt/ro/run/.lock")
    err = open_error(e, "/mnt/ro/run")
    assert is_permanent(err)
    assert "trainguard.load('/mnt/ro/run/step-N', state)" in str(err)


def test_ls_says_a_hand_deleted_data_file_is_missing(tmp_path) -> None:
    """`trainguard ls` (list_checkpoints without verify_data) said "size differs from the manifest"
    for a data file deleted by hand; now "missing", as `trainguard verify` says, and a truncated
    file gives both sizes. Restore falls back past both to the older step."""
    from trainguard.inspect import list_checkpoints

    run = tmp_path / "run ü"
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1)) as m:
        for s in (1, 2, 3):
            state["w"].fill_(s)
            m.save(s, state)
    os.remove(run / "step-000000003" / "data-00000.bin")
    with open(run / "step-000000002" / "data-00000.bin", "r+b") as f:
        f.truncate(8)
    rows = {r.step: r for r in list_checkpoints(str(run))}
    assert (rows[3].status, rows[3].detail) == ("corrupt", "data-00000.bin: missing")
    assert (rows[2].status, rows[2].detail) == ("corrupt", "data-00000.bin: 8 bytes on disk, the manifest says 16 (truncated or replaced)")
    assert rows[1].status == "valid"
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "ls", str(run)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": _SRC, "COLUMNS": "200"})
    assert r.returncode == 0 and "data-00000.bin: missing" in r.stdout, r.stdout + r.stderr
    st = {"w": torch.zeros(4)}
    with tg.CheckpointManager(run) as m:
        assert m.restore(st) == 1
    assert st["w"].tolist() == [1.0] * 4


def test_copy_taken_mid_save_restores_newest_committed_step(tmp_path) -> None:
    """cp -r of a run directory while a save is half-written (a step-N.tmp-<id> directory, and a
    step directory whose data is there but whose manifest is not: an object store's in-place write
    or a copy racing retention), its .lock copied too while the writer still holds the original:
    the copy opens without LockedError, restores the newest committed step, never the half-written
    ones, and drops them. (Already right; a regression guard.)"""
    run = tmp_path / "run ü"
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5)) as m:
        for s in (1, 2):
            state["w"].fill_(s)
            m.save(s, state)
        shutil.copytree(run / "step-000000002", run / "step-000000003.tmp-abc")
        (run / "step-000000004").mkdir()
        shutil.copy(run / "step-000000002" / "data-00000.bin", run / "step-000000004")
        copy = tmp_path / "copy ü"
        subprocess.run(["cp", "-r", str(run), str(copy)], check=True)  # the writer still holds run/.lock
        st = {"w": torch.zeros(4)}
        with tg.CheckpointManager(copy) as c:
            assert c.restore(st) == 2
        assert st["w"].tolist() == [2.0] * 4
        assert sorted(p for p in os.listdir(copy) if p.startswith("step-")) == ["step-000000001", "step-000000002"]
