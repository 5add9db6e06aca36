"""Small findings of the session-34 audits, fixed in session 35."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main


def test_verify_json_names_the_step_of_a_checkpoint_whose_manifest_is_unreadable(tmp_path):
    # `trainguard verify --json` gave "step": null for a checkpoint whose manifest is empty or bad:
    # a script that picks the newest good step had to parse the path itself.
    for s in (4, 5):
        tg.save(tmp_path / "run" / f"step-{s:09d}", {"w": torch.full((8,), float(s))})
    (tmp_path / "run" / "step-000000005" / "manifest.json").write_bytes(b"")
    for where in (tmp_path / "run", tmp_path / "run" / "step-000000005"):
        r = CliRunner().invoke(main, ["verify", "--json", str(where)])
        assert r.exit_code == 1, r.output
        rows = {row["step"]: row for row in json.loads(r.output)}
        assert rows[5]["status"] == "corrupt" and not rows[5]["ok"]
        assert set(rows) == ({4, 5} if where.name == "run" else {5})
