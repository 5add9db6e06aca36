"""The trainguard command: ls, inspect, verify, export (real files, real safetensors/torch loaders)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_json_output_of_ls_inspect_verify(tmp_path):
    """``--json``: what scripts and launchers read instead of the tables (nan metadata as a string,
    exit codes as for the text output)."""
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3)) as mgr:
        for s in (1, 2):
            mgr.save(s, state_for(s), metrics={"loss": float("nan"), "lr": 0.5})
    (tmp_path / layout.step_dir(3)).mkdir()
    data = tmp_path / layout.step_dir(2) / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the big tensor, same size: only --verify and verify see it
    data.write_bytes(bytes(raw))

    rows = json.loads(_run("ls", tmp_path, "--json").output)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "valid"), (2, "valid"), (3, "incomplete")]
    assert rows[0]["bytes"] > 6_000_000 and rows[0]["entries"] == 3 and rows[0]["created"] > 0
    rows = json.loads(_run("ls", tmp_path, "--json", "--verify").output)
    assert [r["status"] for r in rows] == ["valid", "corrupt", "incomplete"] and "checksum" in rows[1]["detail"]

    d = json.loads(_run("inspect", tmp_path / layout.step_dir(1), "--json").output)
    assert d["step"] == 1 and d["world_size"] == 1 and d["metadata"]["metrics"] == {"loss": "nan", "lr": 0.5}
    assert d["entries"]["model"]["tensors"]["weight"] == {"dtype": "float32", "shape": [32, 64], "bytes": 8192, "chunks": 1}
    assert d["entries"]["data"]["tensors"]["big"]["shape"] == [1_500_000] and not d["entries"]["data"]["per_rank"]
    assert sum(d["files"].values()) == d["bytes"] == rows[0]["bytes"]

    r = _run("verify", tmp_path / layout.step_dir(2), "--json")
    (res,) = json.loads(r.output)
    assert r.exit_code == 1 and res["ok"] is False and res["step"] == 2 and "checksum mismatch" in res["errors"][0]
    r = _run("verify", tmp_path / layout.step_dir(1), "--json")
    assert r.exit_code == 0 and json.loads(r.output)[0]["bytes_checked"] > 6_000_000

    # docs/checkpoints.md's one-liner, run as written (the venv's trainguard and python first on PATH)
    doc = (Path(__file__).parent.parent / "docs" / "checkpoints.md").read_text()
    line = re.search(r"^trainguard ls ckpts/run1 --json --verify \|.*$", doc, re.M).group(0)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(line.replace("ckpts/run1", str(tmp_path)), shell=True, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


def test_top_level_help_lists_every_command_with_its_whole_first_sentence():
    r = _run("--help")
    commands = r.output.split("Commands:", 1)[1]
    assert r.exit_code == 0 and "..." not in commands  # click cut them at the terminal width
    for name in ("bench", "consolidate", "convert", "demo", "doctor", "export", "inspect", "ls", "plan", "report", "run", "verify"):
        assert re.search(rf"^  {name} ", commands, re.M), name
    assert "into a full one at DST." in " ".join(commands.split())
