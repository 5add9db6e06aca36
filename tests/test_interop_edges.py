"""Edges found by a second review: manager arguments, hostile manifest timestamps and file
names, missing data files in export/consolidate/convert, foreign-format errors, one-tensor
entries through DCP and back, DCP keys without a dot, strict loads of a tensor over a
structure, and sampler ranks."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main
from trainguard.consolidate import consolidate
from trainguard.convert import convert
from trainguard.export import export
from trainguard.manifest import checksum


def _tamper(d, edit) -> None:
    """Rewrite ``d``'s manifest.json through ``edit(body_dict)`` with a valid checksum."""
    path = os.path.join(d, "manifest.json")
    body = json.loads(open(path, "rb").read())["manifest"]
    edit(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")


def test_manager_refuses_an_unknown_layout_at_construction(tmp_path):
    with pytest.raises(ValueError, match="layout='Full'"):
        tg.CheckpointManager(tmp_path, layout="Full")  # before: every save committed a checkpoint no load accepts


@pytest.mark.parametrize("created", [float("nan"), float("inf"), 1e300, -5.0])
def test_a_manifest_whose_created_is_no_timestamp_is_corrupt_and_ls_says_so(tmp_path, created):
    d = str(tmp_path / "run" / "step-000000001")
    tg.save(d, {"w": torch.ones(3)})
    _tamper(d, lambda b: b.update(created=created))
    # nan/inf are written as JSON's non-standard NaN/Infinity literals: refused as invalid JSON
    with pytest.raises(tg.CorruptCheckpointError, match="no timestamp" if math.isfinite(created) else "is not JSON"):
        tg.load(d, {"w": torch.zeros(3)})
    r = CliRunner().invoke(main, ["ls", str(tmp_path / "run")])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # before: a traceback
    assert "corrupt" in r.output


@pytest.mark.parametrize("name", ["data-\u0660\u0660\u0660\u0660\u0660.bin", "data-00000.bin\n"])
def test_data_file_names_must_be_plain_ascii(tmp_path, name):
    d = str(tmp_path / "step-000000001")
    tg.save(d, {"w": torch.ones(3)})

    def rename(b):
        b["files"] = {name: b["files"]["data-00000.bin"]}
        for e in b["tensors"].values():
            for c in e["chunks"]:
                c[2] = name  # [offsets, sizes, file, offset, length, checksums]

    _tamper(d, rename)
    with pytest.raises(tg.CorruptCheckpointError, match="not allowed"):
        tg.load(d, {"w": torch.zeros(3)})


def test_a_missing_data_file_is_corrupt_for_export_consolidate_and_convert(tmp_path):
    d = str(tmp_path / "step-000000001")
    tg.save(d, {"model": torch.nn.Linear(4, 3)})
    os.unlink(os.path.join(d, "data-00000.bin"))
    for run in (lambda: export(d, str(tmp_path / "m.pt")), lambda: consolidate(d, str(tmp_path / "full")),
                lambda: convert(d, str(tmp_path / "m.safetensors"))):
        with pytest.raises(tg.CorruptCheckpointError, match="data file is missing"):  # before: FileNotFoundError
            run()
    r = CliRunner().invoke(main, ["export", d, "--to", str(tmp_path / "m.pt")])
    assert r.exit_code == 2 and r.output.startswith("error:"), r.output


def test_foreign_files_that_cannot_be_read_or_written_raise_checkpoint_error(tmp_path):
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(tg.CheckpointError, match="cannot read"):  # before: SafetensorError
        convert(tmp_path / "garbage.safetensors", tmp_path / "out" / "step-000000001")
    src = str(tmp_path / "c" / "step-000000001")
    tg.save(src, {"model": {"z": torch.ones(2, dtype=torch.complex128)}})
    with pytest.raises(tg.CheckpointError, match="cannot write"):  # before: KeyError (safetensors has no complex128)
        convert(src, tmp_path / "z.safetensors")
    with pytest.raises(tg.CheckpointError, match="does not exist"):  # before: torch's RuntimeError
        convert(src, tmp_path / "no" / "such" / "z.pt")


def test_a_one_tensor_entry_survives_dcp_and_back_and_strict_load_refuses_a_structure(tmp_path):
    warnings.simplefilter("ignore")  # DCP's pickle warning
    a, b = str(tmp_path / "a" / "step-000000001"), str(tmp_path / "b" / "step-000000001")
    tg.save(a, {"ema": torch.arange(4.0), "model": torch.nn.Linear(2, 2)})
    convert(a, tmp_path / "dcp", dst_format="dcp", entry=None)
    convert(tmp_path / "dcp", b)
    ema = torch.zeros(4)
    state = {"ema": ema, "model": torch.nn.Linear(2, 2)}
    tg.load(b, state)
    assert state["ema"] is ema and torch.equal(ema, torch.arange(4.0))  # before: replaced by {"ema": tensor}
    tg.save(str(tmp_path / "s" / "step-000000001"), {"ema": {"ema": torch.ones(4)}})
    with pytest.raises(tg.StateMismatchError, match="one tensor"):
        tg.load(str(tmp_path / "s" / "step-000000001"), {"ema": torch.zeros(4)})


def test_dcp_keys_split_at_their_first_dot_unless_an_entry_is_given(tmp_path):
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dcp.save({**seq.state_dict(), "bf": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")),
             no_dist=True)
    convert(tmp_path / "d", tmp_path / "split" / "step-000000001")
    m = tg.inspect.describe(tmp_path / "split" / "step-000000001")
    assert sorted(m.objects) == ["0", "bf"]  # before: "bf" went into "model"
    convert(tmp_path / "d", tmp_path / "whole" / "step-000000001", entry="model", dcp_split=False)
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2))
    tg.load(tmp_path / "whole" / "step-000000001", {"model": fresh}, strict=False)
    assert torch.equal(fresh[0].weight, seq[0].weight)


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_sampler_refuses_a_rank_outside_the_world(rank, world):
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        list(tg.ResumableSampler(10, rank=rank, world_size=world))


@pytest.mark.parametrize("position, epoch", [(-3, 0), (11, 0), (5, -1)])
def test_sampler_refuses_a_saved_position_outside_its_dataset(position, epoch):
    sd = {**tg.ResumableSampler(10).state_dict(), "position": position, "epoch": epoch}
    with pytest.raises(tg.CorruptCheckpointError, match="outside 0..10"):
        tg.ResumableSampler(10).load_state_dict(sd)
