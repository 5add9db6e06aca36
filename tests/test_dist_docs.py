"""The examples of docs/distributed.md, run for real: the python block on 2 ranks, then the
documented `trainguard consolidate` command on its checkpoint."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

import trainguard as tg
from trainguard.cli import main as cli

from dist_helper import run_ranks

DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"


def run_doc_block(rank: int, world: int, code: str) -> str:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
    return "ok"


def test_distributed_doc_example(tmp_path: Path) -> None:
    text = DOC.read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    root = str(tmp_path / "ddp")
    res = run_ranks(run_doc_block, 2, code, timeout=90, env={"CKPT_DIR": root, "TRAINGUARD_DEAD_AFTER": "3"})
    assert [r.value for r in res] == ["ok", "ok"]
    assert sorted(os.listdir(f"{root}/step-000000001")) == ["data-00000.bin", "data-00001.bin", "manifest.json"]

    cmd = re.search(r"^trainguard (consolidate \S+ \S+)$", text, re.M).group(1).split()
    cmd[1], cmd[2] = f"{root}/step-000000001", str(tmp_path / "export" / "step-000000001")
    out = CliRunner().invoke(cli, cmd)
    assert out.exit_code == 0, out.output
    torch.manual_seed(5)
    model = nn.Linear(32, 32)
    before = model.weight.clone()
    tg.load(cmd[2], {"model": model}, only=["model"], strict=False)  # 2 -> 1
    assert not torch.equal(model.weight, before)
    again = nn.Linear(32, 32)
    tg.load(f"{root}/step-000000001", {"model": again}, only=["model"], strict=False)
    assert torch.equal(model.weight, again.weight)
