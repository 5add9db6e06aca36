"""The trainguard command: ls, inspect, verify, export (real files, real safetensors/torch loaders)."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import trainguard as tg
from trainguard import layout
from trainguard.cli import main

from crashlib import state_for


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_ls_inspect_verify_export(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    (tmp_path / layout.step_dir(4)).mkdir()
    data = tmp_path / layout.step_dir(2) / "data-00000.bin"
    data.write_bytes(data.read_bytes()[:-1])
    r = _run("ls", tmp_path)
    assert r.exit_code == 0
    lines = {ln.split("│")[1].strip(): ln for ln in r.output.splitlines() if ln.count("│") > 3 and ln.split("│")[1].strip().isdigit()}
    assert "valid" in lines["1"] and "corrupt" in lines["2"] and "valid" in lines["3"] and "incomplete" in lines["4"]

    r = _run("inspect", tmp_path / layout.step_dir(3))
    assert r.exit_code == 0 and "weight  float32 (32, 64)" in r.output and "big  float32 (1500000,)" in r.output

    assert _run("verify", tmp_path / layout.step_dir(3)).exit_code == 0
    r = _run("verify", tmp_path)
    assert r.exit_code == 1 and "CORRUPT" in r.output

    sfile, pfile = tmp_path / "m.safetensors", tmp_path / "m.pt"
    assert _run("export", tmp_path / layout.step_dir(3), "--to", sfile).exit_code == 0
    assert _run("export", tmp_path / layout.step_dir(3), "--to", pfile).exit_code == 0
    want = state_for(3)["model"].state_dict()
    for got in (load_file(str(sfile)), torch.load(pfile, weights_only=True)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "Traceback" not in r.output
    tg.save(tmp_path / "c", state_for(1))
    r = CliRunner().invoke(main, ["export", str(tmp_path / "c"), "--to", str(tmp_path / "x.safetensors"), "--entry", "nope"])
    assert r.exit_code == 2 and "has no entry 'nope'" in r.output
