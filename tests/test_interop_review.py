"""Interop review: what users already have (DCP directories written by torch, Hugging Face
checkpoints) through ``trainguard convert`` and back, and the errors when it cannot be done."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main
from trainguard.convert import convert


def _dcp_of_linear(tmp_path) -> str:
    src = str(tmp_path / "ck" / "step-000000001")
    tg.save(src, {"model": torch.nn.Linear(4, 3)})
    out = str(tmp_path / "dcp")
    convert(src, out, dst_format="dcp", entry=None)
    return out


def test_a_damaged_dcp_directory_is_a_checkpoint_error_and_the_cli_exits_2(tmp_path):
    # DCP raises its CheckpointException, a BaseException: before, it escaped foreign_errors
    # and the command ended in a traceback (exit 1) instead of one error line (exit 2).
    out = _dcp_of_linear(tmp_path)
    os.remove(os.path.join(out, "__0_0.distcp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trusted-source warning
        with pytest.raises(tg.CheckpointError, match=r"cannot read .*FileNotFoundError.*__0_0\.distcp"):
            convert(out, tmp_path / "imported")
    res = CliRunner().invoke(main, ["convert", out, str(tmp_path / "imported2")])
    assert res.exit_code == 2, res.output
    assert "error: cannot read" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "imported").exists() and not (tmp_path / "imported2").exists()
