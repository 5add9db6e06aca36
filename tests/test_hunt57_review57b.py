"""Crash safety of saves, hostile review (hunt57, review57b): SIGKILL at points the crash matrices did not reach.

Each child is killed by SIGKILL (it sends it to itself at the chosen moment: the moment is exact, and
no sleep synchronises anything); its exit is waited for with a bound (``forked``). After the kill: the
previous checkpoints load bit-identical, nothing that ``trainguard ls``/``verify`` or a restore sees
as a checkpoint has lost its data, and the same step saves again.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

import trainguard as tg
from trainguard.inspect import list_checkpoints


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(50_000, generator=g), "b": torch.randn(300, generator=g)},
            "progress": tg.StateDict(step=step)}


def same(a: dict, b: dict) -> bool:
    return (a["progress"]["step"] == b["progress"]["step"] and torch.equal(a["model"]["w"], b["model"]["w"])
            and torch.equal(a["model"]["b"], b["model"]["b"]))


KILL_IN_RAM_TIER_REMOVAL = r"""
import os, signal, sys
import test_hunt57_review57b as t
import trainguard as tg
run, ram = sys.argv[1], sys.argv[2]
mgr = tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=ram, handle_signals=False)
mgr.open()
mgr.save(1, t.state_for(1))
mgr.save(2, t.state_for(2))
mgr.wait()
mgr.ram.wait()
unlink = os.unlink
def killing_unlink(path, *a, **k):  # close() removes the RAM tier: killed once its first data file is gone
    unlink(path, *a, **k)
    if os.path.basename(os.fsdecode(path)).startswith("data-"):
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = killing_unlink
mgr.close()
print("close returned")
"""


def _torn_ram_steps(ram: Path) -> list[str]:
    """RAM-tier step directories that hold a manifest whose data files are not all there."""
    out = []
    for d, _dirs, files in os.walk(ram):
        if "manifest.json" in files:
            wanted = json.loads(Path(d, "manifest.json").read_text())["manifest"]["files"]
            if any(not Path(d, f).exists() for f in wanted):
                out.append(f"{d}: {sorted(files)}")
    return out


def test_kill_while_close_removes_the_ram_tier_leaves_no_manifest_without_its_data(tmp_path, forked, caplog):
    """SIGKILL while ``close()`` removes the RAM tier (its last copy already on disk). Before, the tier was
    removed by one ``rmtree`` of its directory: the data file of a step went before that step's manifest,
    and the kill left ``step-N/manifest.json`` alone in RAM. The next open took it for a checkpoint: the
    restore tried it first, said "checkpoint of step 2 is not usable (data file is missing), trying an
    older one", and only then loaded the copy on disk. Found by killing a RAM-tier run at each of its 87
    write/rename/unlink/fsync calls. Now each step's manifest is removed (durably) before its data."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    code = forked(KILL_IN_RAM_TIER_REMOVAL, run, ram, log=tmp_path / "child.log")
    assert code == -signal.SIGKILL, (tmp_path / "child.log").read_text()
    assert _torn_ram_steps(ram) == []
    assert [r.step for r in list_checkpoints(run) if r.status == "valid"] == [1, 2]
    got = state_for(99)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=str(ram),
                              handle_signals=False) as mgr:
        with caplog.at_level("WARNING", logger="trainguard"):
            assert mgr.restore(got) == 2
        assert "not usable" not in caplog.text, caplog.text
        assert same(got, state_for(2))
        mgr.save(3, state_for(3))
        mgr.wait()
        mgr.ram.wait()
    fresh = state_for(99)
    tg.load(run / "step-000000003", fresh)
    assert same(fresh, state_for(3))
