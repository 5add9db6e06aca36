"""Storage, commit, retention and CLI edges found by the storage review: each test failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import layout
from trainguard.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _flip(path, at: int = 50) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_retention_unlinks_a_linked_in_checkpoint_and_keeps_what_it_points_at(tmp_path):
    # A checkpoint linked into a run directory (ln -s /pretrained/step-000000000 run/): retention
    # and debris cleanup remove the link. Before, the manifest of the checkpoint *outside* the run
    # directory was deleted (through the link) and the link stayed, "removed" again at every open.
    pre = tmp_path / "pretrained" / layout.step_dir(0)
    tg.save(pre, {"w": torch.ones(4)})
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(pre, run / layout.step_dir(0))
    state = {"w": torch.zeros(4)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as m:
        assert m.restore(state) == 0
        for s in (1, 2, 3):
            m.save(s, state)
    assert sorted(os.listdir(run)) == [".lock", ".trainguard-run-id", "events.jsonl", layout.step_dir(2), layout.step_dir(3)]
    assert tg.verify(pre).ok  # the pretrained checkpoint is untouched


def test_verify_of_a_step_directory_with_a_corrupt_manifest_reports_it_corrupt(tmp_path):
    # Before: "holds no checkpoint: no manifest.json ... nothing to verify" (exit 2, no JSON),
    # as if the manifest were absent, for a manifest that is there and fails its checksum.
    tg.save(tmp_path / layout.step_dir(1), {"w": torch.ones(8)})
    step = tmp_path / layout.step_dir(1)
    _flip(step / layout.MANIFEST)
    r = _run("verify", step)
    assert r.exit_code == 1, r.output
    assert "CORRUPT" in r.output and "checksum mismatch" in r.output and "no manifest" not in r.output
    rows = json.loads(_run("verify", step, "--json").output)
    assert [(x["status"], x["ok"]) for x in rows] == [("corrupt", False)]
    assert "checksum mismatch" in rows[0]["errors"][0]


def test_python_dash_m_trainguard_cli_runs_the_command(tmp_path):
    # `python -m trainguard.cli verify BAD` ran nothing and exited 0: a script read "verified".
    tg.save(tmp_path / layout.step_dir(1), {"w": torch.ones(8)})
    _flip(tmp_path / layout.step_dir(1) / "data-00000.bin", at=3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.path.dirname(tg.__path__[0]),
                                                                     os.environ.get("PYTHONPATH", "")] if p)}
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "verify", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "CORRUPT" in r.stdout


def test_convert_into_an_existing_checkpoint_says_how_to_proceed(tmp_path):
    # Before: "pass overwrite=True to replace it", an option neither convert() nor the command has.
    tg.save(tmp_path / layout.step_dir(0), {"model": {"w": torch.ones(3)}})
    torch.save({"w": torch.zeros(3)}, tmp_path / "w.pt")
    r = _run("convert", tmp_path / "w.pt", tmp_path / layout.step_dir(0))
    assert r.exit_code == 2, r.output
    assert "overwrite" not in r.output and "convert into a new directory" in r.output
    back = {"model": {"w": torch.empty(3)}}
    tg.load(tmp_path / layout.step_dir(0), back)
    assert torch.equal(back["model"]["w"], torch.ones(3))  # the checkpoint is untouched


def test_a_failed_export_or_convert_leaves_the_earlier_file_as_it_was(tmp_path, monkeypatch):
    # export/convert wrote straight into the output file: a full disk half-way through destroyed
    # the export of an earlier run. They write a temporary file beside it and rename it.
    import errno

    import safetensors.torch

    from trainguard import stwrite
    from trainguard.convert import convert
    from trainguard.export import export

    model = torch.nn.Linear(4, 3)
    tg.save(tmp_path / "ck", {"model": model})
    pt, st = tmp_path / "w.pt", tmp_path / "w.safetensors"
    assert export(tmp_path / "ck", pt) == 2 and export(tmp_path / "ck", pt) == 2  # a rerun replaces it
    convert(tmp_path / "ck", st)
    before = {p: p.read_bytes() for p in (pt, st)}

    def full_disk(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)

    def full_disk_streamed(storage, path, *args, **kwargs):  # convert to .safetensors streams (session 51)
        return full_disk(None, path)

    monkeypatch.setattr(stwrite, "write_batches", full_disk_streamed)
    with pytest.raises(tg.CheckpointError, match="No space left"):
        export(tmp_path / "ck", pt)
    with pytest.raises(tg.CheckpointError, match="No space left"):
        convert(tmp_path / "ck", st)
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in (pt, st)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "w.pt", "w.safetensors"]  # no temporary file left
    assert torch.equal(torch.load(pt, weights_only=True)["weight"], model.weight.detach())


def test_the_ram_tier_of_a_run_does_not_depend_on_how_its_root_is_spelled(tmp_path):
    # ram_dir hashed the root as given when it held "://": "memory://r/run" and "memory://r/run/"
    # (or "file:///x" and "/x") had two RAM tiers, and a restart spelled otherwise missed a step
    # that only the RAM tier held.
    base = tmp_path / "shm"
    base.mkdir()
    model = torch.nn.Linear(4, 4)
    spellings = [("memory://rt-spell/run", "memory://rt-spell/run/"), (f"file://{tmp_path}/run", f"{tmp_path}/run/")]
    for first, again in spellings:
        with tg.CheckpointManager(first, save=tg.EveryNSteps(1), ram_tier=str(base)) as mgr:
            mgr.save(1, {"model": model})
            mgr.wait()
            dirs = {mgr.ram.dir}
            mgr.close(keep_ram_tier=True)
        with tg.CheckpointManager(again, ram_tier=str(base)) as mgr:
            dirs.add(mgr.ram.dir)
            assert mgr.restore({"model": torch.nn.Linear(4, 4)}) == 1
        assert len(dirs) == 1, dirs


def test_a_manifest_deleted_between_its_lookup_and_its_read_is_no_checkpoint(tmp_path, monkeypatch):
    # On an object store the read of a manifest deleted after read_manifest looked it up raised
    # fsspec's FileNotFoundError as is (restore does not fall back on that); now the same
    # NotACheckpointError as a manifest that is not there.
    from trainguard.storage.fsspec import FsspecStorage

    root = "memory://manifest-race/run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.save(2, {"w": torch.full((2,), 2.0)})
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.rm("/manifest-race/run/step-000000002/manifest.json")
    real = FsspecStorage.exists
    monkeypatch.setattr(FsspecStorage, "exists", lambda self, p: p.endswith("step-000000002/manifest.json") or real(self, p))
    with pytest.raises(tg.NotACheckpointError, match="deleted while it was read"):
        tg.load(f"{root}/step-000000002", {"w": torch.zeros(2)})
