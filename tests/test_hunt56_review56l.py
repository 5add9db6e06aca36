"""Session 56, helper review56l: ``trainguard report`` said nothing of events a user must see after a long run.

A restore that skipped an unusable checkpoint (``restore_skip``: which step, why), retention that found a kept
checkpoint's files cut short (``retention_damaged``), the rendezvous store gone (``store_lost``) and the other
events of ``trainguard.problems.KINDS`` were in ``events.jsonl`` only: the report printed the same lines as for a
run with none of them. It now prints a line per event name, once per step whichever ranks logged it (every rank
logs ``restore_skip``, and each restart skips the same checkpoint again), and lists them in ``--json``
(``problems``).
"""

from __future__ import annotations

import json
import os

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import report as rep
from trainguard.cli import main
from trainguard.events import EventLog, read_events


def _damaged_run(run):
    """A real run: step 3 cut short before the save of step 4 (retention finds it), step 4 cut short after; two
    restores (a restart) skip 4 and 3 and restore 2."""
    state = {"w": torch.arange(50_000.0)}
    with tg.CheckpointManager(run, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state, force=True)
        data = run / "step-000000003" / "data-00000.bin"
        os.truncate(data, data.stat().st_size // 2)
        mgr.save(4, state, force=True)
    data = run / "step-000000004" / "data-00000.bin"
    os.truncate(data, data.stat().st_size // 2)
    for _ in range(2):
        with tg.CheckpointManager(run, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
            assert mgr.restore({"w": torch.zeros(50_000)}) == 2


def test_report_names_skipped_restores_and_damaged_kept_checkpoints(tmp_path):
    run = tmp_path / "run"
    _damaged_run(run)
    logged = [(e["event"], e.get("step")) for e in read_events(run)]
    assert ("retention_damaged", 3) in logged and logged.count(("restore_skip", 4)) == 2, logged  # the case
    # rank 1 of the same job skipped the same checkpoints (every rank restores): its events, as it logs them
    for step, reason in [(4, "rank 1: data-00000.bin cut short"), (3, "rank 1: data-00000.bin cut short")]:
        EventLog(run / "events.jsonl", rank=1).emit("restore_skip", step=step, reason=reason)
    EventLog(run / "events.jsonl", rank=-1, mono=True).emit("store_lost", error="RendezvousConnectionError: gone",
                                                            grace_s=30.0)

    s = rep.summary(rep.tally_log(run), root=run)
    assert s == rep.summarize(list(read_events(run)))  # the fast path and the parsed events agree
    skips = [x for x in s["problems"] if x["event"] == "restore_skip"]
    assert sorted(x["step"] for x in skips) == [3, 4], s["problems"]  # once per step: 4 events each, 2 ranks
    assert all(x["count"] == 3 and sorted(x["ranks"]) == [0, 1] for x in skips), skips
    assert [x["step"] for x in s["problems"] if x["event"] == "retention_damaged"] == [3], s["problems"]
    assert [x["event"] for x in s["problems"]].count("store_lost") == 1, s["problems"]

    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    skip = [ln for ln in lines if ln.startswith("restore skipped")]
    assert len(skip) == 1 and skip[0].startswith("restore skipped    2 checkpoints") and "steps 4, 3" in skip[0], res.output
    assert "rank 1: data-00000.bin cut short" in skip[0], res.output  # the last reason logged
    damaged = [ln for ln in lines if ln.startswith("damaged kept       1 checkpoint ")]
    assert len(damaged) == 1 and "step 3;" in damaged[0], res.output
    assert any(ln.startswith("store lost         1 ") and "RendezvousConnectionError: gone" in ln for ln in lines), res.output

    res = CliRunner().invoke(main, ["report", "--json", str(run)])
    assert res.exit_code == 0, res.output
    got = {(x["event"], x["step"]) for x in json.loads(res.output)["problems"]}
    assert {("restore_skip", 4), ("restore_skip", 3), ("retention_damaged", 3), ("store_lost", None)} <= got, got


def test_report_of_a_run_with_none_prints_no_such_line(tmp_path):
    """A sound run: no line more than before, ``problems`` empty."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.arange(10.0)}, force=True)
    with tg.CheckpointManager(run, keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        assert mgr.restore({"w": torch.zeros(10)}) == 3
    s = rep.summary(rep.tally_log(run), root=run)
    assert s["problems"] == [], s
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 0 and len(res.output.splitlines()) == 6, res.output
