"""A *sync* save stuck in a storage call (session 25): its write runs in the training thread, so
nothing in the process raised; the hang watchdog was paused by the save and the worker hung for
good (its peers waiting in their next collective). Under the watchdog (``trainguard run``) a
storage call of a save in flight past the manager's timeout and a grace now ends the worker with
the hang exit code, its stacks and the call named. The stuck call is a real ``pwrite`` (or
directory creation) that never returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.elastic.watchdog import HANG_EXIT, stuck_limit
from trainguard.events import EVENTS_FILE

SCRIPT = textwrap.dedent("""
    import sys, threading, torch, trainguard as tg
    from trainguard.storage import local
    what = sys.argv[2]
    state = {"a": torch.ones(1 << 16), "b": torch.arange(1000.0)}
    mgr = tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1), timeout=1.0).open()
    if what == "pwrite":
        orig = local._LocalWriter.pwrite
        def stuck(self, data, offset):
            if sys.argv[3] == "held":
                print("in the write", flush=True)
                threading.Event().wait()  # a write that never returns
            return orig(self, data, offset)
        local._LocalWriter.pwrite = stuck
    else:  # the first call of a save on a mount that stopped answering
        def stuck_mkdir(self, path):
            print("in the mkdir", flush=True)
            threading.Event().wait()
        local.LocalStorage.makedirs = stuck_mkdir
    mgr.save(1, state)
    print("save returned", flush=True)
    mgr.close()
""")


def _run(tmp_path: Path, what: str, held: str = "held") -> tuple[subprocess.CompletedProcess, list[dict]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rd = tmp_path / "rundir"
    rd.mkdir()
    env = {**os.environ, "TRAINGUARD_WATCHDOG": "1", "TRAINGUARD_RUN_DIR": str(rd), "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("TRAINGUARD_HANG_TIMEOUT", None)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), what, held], env=env,
                       capture_output=True, text=True, timeout=120)
    ev = rd / EVENTS_FILE
    events = [json.loads(line) for line in ev.read_text().splitlines()] if ev.exists() else []
    return p, events


@pytest.mark.timeout(180)
@pytest.mark.parametrize("what", ["pwrite", "makedirs"])
def test_a_sync_save_stuck_in_a_storage_call_ends_the_worker_under_the_watchdog(tmp_path: Path, what: str) -> None:
    p, events = _run(tmp_path, what)
    assert p.returncode == HANG_EXIT, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "save returned" not in p.stdout
    call = "a write of" if what == "pwrite" else "creating directory"
    assert "a save has been stuck for" in p.stderr and call in p.stderr, p.stderr[-3000:]
    assert f"limit {stuck_limit(1.0):.1f} s" in p.stderr
    hang = [e for e in events if e.get("event") == "hang"]
    assert len(hang) == 1 and call in hang[0]["stuck_call"] and hang[0]["idle_s"] > stuck_limit(1.0)
    assert "stuck" in hang[0]["stacks"] and list((tmp_path / "rundir").glob("hang-rank0-*.txt"))
    assert not [d for d in (tmp_path / "ckpt").iterdir() if d.name.startswith("step-") and ".tmp-" not in d.name]


@pytest.mark.timeout(180)
def test_a_sync_save_that_returns_is_no_hang(tmp_path: Path) -> None:
    p, events = _run(tmp_path, "pwrite", held="free")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "save returned" in p.stdout
    assert not [e for e in events if e.get("event") == "hang"]
    assert (tmp_path / "ckpt" / "step-000000001" / "manifest.json").exists()


def _rank_with_a_stuck_sync_write(rank: int, world: int, root: str) -> str:
    import threading as th

    import torch

    import trainguard as tg
    from trainguard.storage import local as loc

    orig = loc._LocalWriter.pwrite

    def stuck(self, data, offset):  # rank 1's writes of step 2 never return
        if "step-000000002" in self.path:
            th.Event().wait()
        return orig(self, data, offset)

    if rank == 1:
        loc._LocalWriter.pwrite = stuck
    state = {f"t{i}": torch.full((64, 64), float(i)) for i in range(8)}  # replicated: both ranks write a share
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=120.0, handle_signals=False).open()
    mgr.save(1, state)
    mgr.timeout = 3.0  # step 2: rank 0's rounds give up after 3 s, rank 1's watchdog after stuck_limit(3)
    try:
        mgr.save(2, state)
        return "returned"
    except tg.CheckpointError as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


@pytest.mark.timeout(180)
def test_two_ranks_one_stuck_in_a_sync_write(tmp_path: Path) -> None:
    """Rank 1's sync save of step 2 never returns from a write: rank 0 fails the save at its round's
    timeout (naming rank 1), rank 1's watchdog ends it with the hang exit code once the limit is
    past (before: rank 1 hung for good, and rank 0 would wait for it in its next collective);
    step 1 stays the newest checkpoint."""
    from dist_helper import run_ranks

    rd = tmp_path / "rundir"
    rd.mkdir()
    env = {"TRAINGUARD_WATCHDOG": "1", "TRAINGUARD_RUN_DIR": str(rd)}
    out = run_ranks(_rank_with_a_stuck_sync_write, 2, str(tmp_path / "run"), timeout=120, env=env, check=False)
    assert out[0].exitcode == 0 and out[0].value.startswith("RankFailureError") and "[1]" in out[0].value, out[0]
    assert out[1].exitcode == HANG_EXIT and not out[1].timed_out, out[1]
    events = [json.loads(line) for line in (rd / EVENTS_FILE).read_text().splitlines()]
    hang = [e for e in events if e.get("event") == "hang"]
    assert [e["rank"] for e in hang] == [1] and "step-000000002" in hang[0]["stuck_call"], hang
    steps = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-") and ".tmp-" not in p.name)
    assert steps == ["step-000000001"]
