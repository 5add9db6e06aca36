"""Session 45's leftovers, fixed in session 46: each test runs the library or the command (in a
process of its own, or in this one through click's CliRunner) on real files and fails on the code
before its fix (3dac339)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_hunt45_cli import _cli, _cli_here, _run_dir
from trainguard.inspect import list_checkpoints

from conftest import run_py


def _ckpt(path: Path) -> dict[str, torch.Tensor]:
    weights = {"w": torch.arange(400.0 * 400).reshape(400, 400)}
    tg.save(path, {"model": weights})
    return weights


def test_saving_under_a_file_names_the_file_in_the_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`consolidate ck afile/sub` said "afile/sub is a file", a path that does not exist; the file
    in the way is `afile`. Both the command and tg.save name it; nothing is written."""
    _ckpt(tmp_path / "ck")
    (tmp_path / "afile").write_text("user data\n")
    res = _cli_here(monkeypatch, "consolidate", "ck", "afile/sub", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"{tmp_path / 'afile'} is a file, not a directory" in res.stderr
    assert f"{tmp_path / 'afile' / 'sub'} is a file" not in res.stderr
    with pytest.raises(tg.CheckpointError, match=r"afile is a file, not a directory \(the checkpoint's path .*afile/a/b is under"):
        tg.save(tmp_path / "afile" / "a" / "b", {"w": torch.zeros(2)})
    assert (tmp_path / "afile").read_text() == "user data\n"
    with pytest.raises(tg.CheckpointError, match=r"afile is a file, not a directory; save"):  # the file itself
        tg.save(tmp_path / "afile", {"w": torch.zeros(2)})


def test_a_directory_in_place_of_a_data_file_is_called_one(tmp_path: Path) -> None:
    """A data file replaced by a directory read as "4096 bytes, manifest says 640000" in verify,
    `ls` and load (the directory's st_size). Each now says it is a directory."""
    run = tmp_path / "run"
    ck = run / "step-000000005"
    weights = _ckpt(ck)
    (ck / "data-00000.bin").unlink()
    (ck / "data-00000.bin").mkdir()
    res = _cli("verify", str(ck), cwd=tmp_path)
    assert res.returncode == 1 and "data-00000.bin: a directory, not a data file of 640000 bytes" in res.stdout, res
    assert "4096" not in res.stdout
    [row] = list_checkpoints(str(run))
    assert row.status == "corrupt" and "a directory, not a data file" in row.detail
    target = {"model": {"w": torch.zeros_like(weights["w"])}}
    with pytest.raises(tg.CorruptCheckpointError, match="a directory, not a data file of 640000 bytes"):
        tg.load(ck, target)
    assert not target["model"]["w"].any()


def test_a_truncated_data_file_still_reads_as_one(tmp_path: Path) -> None:
    """The other side of the test above: a short regular file keeps its byte counts."""
    ck = tmp_path / "ck"
    _ckpt(ck)
    with open(ck / "data-00000.bin", "r+b") as f:
        f.truncate(100)
    res = _cli("verify", str(ck), cwd=tmp_path)
    assert res.returncode == 1 and "100 bytes on disk, the manifest says 640000 (truncated or replaced)" in res.stdout


def test_convert_entry_empty_is_refused_both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`convert --entry ''` exported the `model` entry and imported into `model`, where `export
    --entry ''` is an error: '' is no entry's name, refused before anything is written."""
    _ckpt(tmp_path / "ck")
    ok = _cli_here(monkeypatch, "convert", "ck", "w.safetensors", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    for src, dst in (("ck", "out.safetensors"), ("w.safetensors", "imported")):
        res = _cli_here(monkeypatch, "convert", src, dst, "--entry", "", cwd=tmp_path)
        assert res.returncode == 2 and "entry '' names no entry" in res.stderr, res
        assert not (tmp_path / dst).exists()
    res = _cli_here(monkeypatch, "convert", "w.safetensors", "named", "--entry", "ema", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "named" / "manifest.json").read_text())["manifest"]["objects"].keys() == {"ema"}


def test_report_plot_to_a_name_ending_in_a_dot_is_refused(tmp_path: Path) -> None:
    """`report --plot out.` wrote `out..png` (matplotlib's default suffix after the dot). Now one
    `error:` line saying what to name, before the summary; nothing is written."""
    run = _run_dir(tmp_path)
    res = _cli("report", str(run), "--plot", "out.", cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.startswith("error: --plot out.: the name ends with a dot") and len(res.stderr.splitlines()) == 1
    assert "out.png" in res.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


FIFO_SCRIPT = r"""
import os, sys, torch, trainguard as tg
from trainguard.tiers import RUN_ID, ram_dir
run, what = sys.argv[1], sys.argv[2]
if what == "lock":  # a plain save into a run's step directory looks for the run's lock holder
    os.mkdir(run)
    os.mkfifo(os.path.join(run, ".lock"))
    tg.save(os.path.join(run, "step-000000100"), {"w": torch.ones(2)})
else:  # a RAM-tier manager's open reads the run ids of this user's other RAM directories
    other = os.path.join(os.path.dirname(ram_dir(run)), "fifo-" + os.path.basename(run))
    os.makedirs(other)
    os.mkfifo(os.path.join(other, RUN_ID))
    try:
        with tg.CheckpointManager(run, ram_tier=True, handle_signals=False) as mgr:
            mgr.save(1, {"w": torch.ones(2)}, force=True)
    finally:
        os.unlink(os.path.join(other, RUN_ID))
        os.rmdir(other)
print("done")
"""


@pytest.mark.parametrize("what", ["lock", "ram"])
def test_a_fifo_in_place_of_a_lock_or_run_id_file_does_not_hang(tmp_path: Path, what: str) -> None:
    """A FIFO named `.lock` (a plain save into `run/step-N` tests the run's lock) or
    `.trainguard-run-id` in another RAM directory of this user (a RAM-tier manager's open reads
    them) blocked the open until a writer came: forever. They are opened without waiting now."""
    res = run_py(["-c", FIFO_SCRIPT, str(tmp_path / f"run-{what}"), what], timeout=60)
    assert res.returncode == 0 and res.stdout.strip().endswith("done"), res


def test_trainguard_run_leaves_the_scripts_own_arguments_alone(tmp_path: Path) -> None:
    """`trainguard run ... train.py --log x --master` failed with "ambiguous option: --log could match
    --log-dir, --log_dir, ..." (argparse matched the script's arguments against torchrun's options as
    abbreviations; torchrun does the same). The worker now gets them as given; a launcher option
    that is not one still fails as before."""
    script = tmp_path / "train.py"
    script.write_text("import json, sys\nopen(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n")
    given = ["--log", "x", "--master", "--max", "3", "--nnodes", "5"]
    base = ["run", "--standalone", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run")]
    res = _cli(*base, str(script), str(tmp_path / "argv.json"), *given, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "argv.json").read_text()) == given
    res = _cli(*base, "--bogus", str(script), cwd=tmp_path)
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.stderr, res.stderr[-3000:]


def test_restore_at_a_step_retention_deleted_names_the_steps_held(tmp_path: Path) -> None:
    """`restore(state, step=11)` after KeepLatest(2) kept 12 and 13 said only "holds no checkpoint at or
    before step 11"; it now names the steps the run holds. A step that is held still restores."""
    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in range(10, 14):
            mgr.save(step, {"model": model})
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match=r"at or before step 11; it holds step\(s\) 12, 13: pass one"):
            mgr.restore({"model": model}, step=11)
        assert mgr.restore({"model": model}, step=12) == 12


def test_exit_code_for_something_not_an_exception_says_what_to_pass() -> None:
    """`tg.exit_code_for(str(e))` raised a bare AttributeError from inside; now a TypeError saying to
    pass the exception itself."""
    with pytest.raises(TypeError, match=r"exit_code_for\('boom'\): pass the exception itself"):
        tg.exit_code_for("boom")  # type: ignore[arg-type]
    assert tg.exit_code_for(ValueError("boom")) == 1 and tg.exit_code_for(None) == 0


def test_the_one_level_up_hint_looks_past_an_unreadable_subdirectory(tmp_path: Path, caplog, monkeypatch) -> None:
    """freshhint.nested_runs (a fresh start in a directory whose subdirectory holds a run) gave up at the
    first subdirectory it could not list, saying nothing of the run beside it; now that one is skipped.
    (Listings fail here by a stand-in: this machine runs the tests as root, which reads any mode.)"""
    import logging

    import trainguard.commit as commit

    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path / "ckpts" / "run1", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": model})
    (tmp_path / "ckpts" / "aaa-locked").mkdir()  # before or after run1 in the listing: either stopped the hint
    real = commit.list_steps

    def list_steps(storage, root, **kw):  # type: ignore[no-untyped-def]
        if root.endswith("aaa-locked"):
            raise PermissionError(13, "Permission denied", root)
        return real(storage, root, **kw)

    monkeypatch.setattr(commit, "list_steps", list_steps)
    caplog.set_level(logging.WARNING, logger="trainguard")
    with tg.CheckpointManager(tmp_path / "ckpts", handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) is None
    said = [r.getMessage() for r in caplog.records if "starts this run afresh" in r.getMessage()]
    assert len(said) == 1 and "'run1' (newest step 1)" in said[0], said
