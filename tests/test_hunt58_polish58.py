"""polish58: user-facing messages.

1. ``tg.load`` of a damaged step whose error said what to do already (a missing file: copy the checkpoint
   whole or load another; a load that had begun writing: load one that verifies first) got a second piece of
   advice from ``userload.py`` (``; use an earlier step that verifies (...)``); a renamed step directory was
   told both to rename it and to use an earlier step. Now one piece of advice (``srcnamed.advised``).
2. A ``DTensor.from_local`` of other (uneven) split sizes, 3 and 5 rows of 8 on 2 ranks, was saved with the
   even split's offsets: the manifest's chunk ran past the tensor and no load took it; a load into one read
   at those offsets. Now both are refused naming the tensor, the shard sizes and the split that works.
3. ``trainguard doctor`` took ``--node-failures-per-day -1`` (0, nan, inf), ``--node-mtbf 0s`` and
   ``--step-time 0`` without a word unless every input of the interval check was given; negative durations
   were "cannot read '-1s' as a duration". Each refusal now names the option and its range.
4. A command given ``--json`` printed its error as text on stderr: now one JSON object on stdout.
5. ``memory://run`` was shown as ``memory:///run`` beside ``memory://run`` in one message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main

from dist_helper import run_ranks


def _state(v: float = 0.0) -> dict:
    return {"a": tg.StateDict(w=torch.full((64,), v)), "b": tg.StateDict(w=torch.full((1000,), v))}


def _run(root: Path, steps: int = 2) -> Path:
    for s in range(1, steps + 1):
        tg.save(root / f"step-{s:09d}", _state(float(s)))
    return root


def _load_error(path: str | Path) -> str:
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(path, _state())
    return str(e.value)


# 1. one piece of advice -----------------------------------------------------------------------------------

def test_a_missing_data_file_is_told_one_piece_of_advice(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    (run / "step-000000002" / "data-00000.bin").unlink()
    msg = _load_error(run / "step-000000002")
    assert msg.endswith(f"copy the checkpoint directory whole, or load an earlier step that verifies ({run} holds "
                        f"step 1: `trainguard verify {run}` says which verify)"), msg
    assert "use an earlier step" not in msg and "load another checkpoint" not in msg, msg  # before: both, back to back


def test_a_partly_loaded_state_is_told_one_piece_of_advice(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    f = run / "step-000000002" / "data-00000.bin"
    raw = bytearray(f.read_bytes())
    raw[-8] ^= 0xFF  # in entry "b", read after "a" was written into the state
    f.write_bytes(bytes(raw))
    msg = _load_error(run / "step-000000002")
    assert "The load had begun writing into the state" in msg, msg
    assert msg.endswith(f"load an earlier step that verifies before using it ({run} holds step 1: "
                        f"`trainguard verify {run}` says which verify)."), msg
    assert "use an earlier step" not in msg and "load a checkpoint that verifies" not in msg, msg


def test_a_renamed_step_directory_is_told_to_rename_it_only(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    (run / "step-000000002").rename(run / "step-000000007")
    msg = _load_error(run / "step-000000007")
    assert msg.endswith("rename it step-000000002, or to a name that is not a step's"), msg  # before: "; use an earlier step ..."


# 2. uneven DTensor.from_local -----------------------------------------------------------------------------

def _uneven(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = (3, 5)[rank]
    uneven = DTensor.from_local(torch.full((rows, 4), float(rank)), mesh, [Shard(0)], shape=torch.Size((8, 4)), stride=(4, 1))
    out: dict = {}
    try:
        tg.save(f"{root}/uneven", {"m": tg.StateDict(w=uneven)}, timeout=60)
        out["save"] = None
    except tg.CheckpointError as e:
        out["save"] = str(e)
    tg.save(f"{root}/even", {"m": tg.StateDict(w=DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)]))}, timeout=60)
    try:
        tg.load(f"{root}/even", {"m": tg.StateDict(w=uneven)}, timeout=60)
        out["load"] = None
    except tg.CheckpointError as e:
        out["load"] = str(e)
    return out


def test_an_uneven_from_local_dtensor_is_refused_naming_the_tensor_and_sizes(tmp_path: Path) -> None:
    out = [r.value for r in run_ranks(_uneven, 2, str(tmp_path), timeout=90)]
    for rank, v in enumerate(out):
        save = v["save"]
        assert save is not None, "the save went through (before: a manifest whose chunk runs past the tensor)"
        for r, rows in ((0, 3), (1, 5)):  # every rank's error names every rank's shard
            assert "tensor 'm/w': DTensor of shape (8, 4)" in save and f"({rows}, 4) on rank {r}" in save, save
        assert "torch.chunk: 4, 4 rows of dim 0 over the 2 ranks" in save and "passed a different set" not in save, save
        load = v["load"]
        assert load is not None and "tensor 'm/w'" in load and f"({(3, 5)[rank]}, 4) on rank {rank}" in load, (rank, load)
    assert not (tmp_path / "uneven" / "manifest.json").exists()


# 3. doctor's and plan's numbers ---------------------------------------------------------------------------

_BAD = [("--node-failures-per-day", v, "> 0") for v in ("-1", "0", "nan", "inf")] + [
    ("--node-mtbf", "0s", "> 0"), ("--node-mtbf", "-5d", "> 0"), ("--step-time", "0", "> 0"), ("--step-time", "-2s", "> 0"),
    ("--save-stall", "0s", "> 0"), ("--save-stall", "nan", "> 0"), ("--restart", "-1s", ">= 0"), ("--restart", "inf", ">= 0"),
    ("--save-stall", "1e400s", "> 0")]


@pytest.mark.parametrize("option,value,rng", _BAD)
def test_doctor_refuses_a_number_out_of_range_naming_the_option(tmp_path: Path, option: str, value: str, rng: str) -> None:
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    r = CliRunner().invoke(main, ["doctor", str(script), option, value])  # alone: no interval check asked for
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert f"Invalid value for '{option}': {value}: a finite" in r.stderr and rng in r.stderr, r.stderr


@pytest.mark.parametrize("option,value,rng", [("--node-mtbf", "-5d", "> 0"), ("--node-mtbf", "nan", "> 0"), ("--step-time", "-2s", "> 0"),
                                              ("--save-duration", "-1s", "> 0"), ("--save-duration", "nan", "> 0"),
                                              ("--restart", "nan", ">= 0")])
def test_plan_refuses_a_number_out_of_range_naming_the_option(option: str, value: str, rng: str) -> None:
    """``plan`` checked the ranges (make_plan) of the numbers it could read; a negative or nan duration was
    "cannot read '-1s' as a duration", no range said."""
    args = {"--restart": "1m", "--save-stall": "30s"}
    if option != "--node-mtbf":
        args["--node-failures-per-day"] = "0.01"
    argv = ["plan", *[x for kv in args.items() for x in kv], option, value]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and f"'{option}': {value}: a finite" in r.stderr and rng in r.stderr, (argv, r.stderr)


# 4. --json errors -----------------------------------------------------------------------------------------

def _json_cases(tmp: Path) -> list[tuple[list[str], int, str]]:
    script = tmp / "s.py"
    script.write_text("x = 1\n")
    gone = str(tmp / "gone")
    return [(["verify", gone, "--json"], 2, "NotACheckpointError"), (["ls", gone, "--json"], 2, "NotACheckpointError"),
            (["inspect", gone, "--json"], 2, "NotACheckpointError"), (["report", str(tmp), "--json"], 2, "command"),
            (["report", gone, "--json"], 2, "usage"), (["plan", "--json", "--restart", "1m", "--save-stall", "30s"], 2, "usage"),
            (["doctor", str(script), "--json", "--bogus"], 2, "usage"), (["bench", gone, "--size", "-5", "--json"], 2, "usage")]


def test_every_command_with_json_fails_with_one_json_object(tmp_path: Path) -> None:
    for argv, code, kind in _json_cases(tmp_path):
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == code and r.stderr == "", (argv, r.exit_code, r.stderr)
        out = json.loads(r.stdout)  # before: nothing on stdout, an "error:" line on stderr
        assert out["kind"] == kind and out["exit_code"] == code and out["error"], (argv, out)
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "gone")])  # without --json: as it was
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("error: "), r.stderr


def test_doctor_json_of_a_script_without_the_hook_is_one_json_list(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    r = CliRunner().invoke(main, ["doctor", str(script), "--json"])
    findings = json.loads(r.stdout)  # before: the list, then a text error on stderr
    assert r.exit_code == 1 and r.stderr == "", r.stderr
    assert findings[-1]["check"] == "hook" and findings[-1]["severity"] == "error", findings[-1]
    assert "defines no trainguard_state()" in findings[-1]["message"], findings[-1]


# 5. memory:// -------------------------------------------------------------------------------------------

def test_memory_urls_are_shown_as_given(tmp_path: Path) -> None:
    import fsspec

    run = f"memory://polish58-{tmp_path.name}"
    for s in (1, 2):
        tg.save(f"{run}/step-{s:09d}", _state(float(s)))
    fsspec.filesystem("memory").rm(f"/polish58-{tmp_path.name}/step-000000002/data-00000.bin")
    for given in (run, run.replace("://", ":///")):
        msg = _load_error(f"{given}/step-000000002")
        assert msg.startswith(f"{run}/step-000000002/data-00000.bin: data file is missing"), msg
        assert f"`trainguard verify {run}`" in msg and "memory:///" not in msg, msg  # before: both forms in one message
    r = CliRunner().invoke(main, ["inspect", f"{run}/step-000000009"])
    assert r.exit_code == 2 and f"`trainguard ls {run}`" in r.stderr and "memory:///" not in r.stderr, r.stderr
    r = CliRunner().invoke(main, ["verify", run.replace("://", ":///")])
    assert f"CORRUPT {run}/step-000000002" in r.stdout and "memory:///" not in r.stdout, r.stdout
