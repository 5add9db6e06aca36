"""Hunt 49 (saveevent49): an async save's ``save`` event is written when it commits, not when the next
``save()`` collects it (a process killed in between left a committed checkpoint out of the log)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import trainguard as tg
from trainguard.events import read_events

SRC = str(Path(__file__).resolve().parents[1] / "src")

_CHILD = textwrap.dedent("""
    import sys, time, torch
    import trainguard as tg
    root = sys.argv[1]
    model = torch.nn.Linear(64, 64)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                               handle_signals=False).open()
    mgr.save(1, {"model": model})
    mgr.save(2, {"model": model})
    h = mgr.save(3, {"model": model})
    end = time.monotonic() + 60
    while not h.done() and time.monotonic() < end:  # committed (the manifest is durable); no save(), wait() nor close()
        time.sleep(0.01)
    print("committed" if h.done() else "timeout", flush=True)
    time.sleep(120)  # SIGKILLed by the test
""")


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        return proc.stdout.readline() if sel.select(timeout) else ""
    finally:
        sel.close()


def test_async_save_committed_just_before_a_kill_is_in_the_event_log(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = _read_line(proc, 60)
        assert line.strip() == "committed", line
        os.kill(proc.pid, signal.SIGKILL)  # right after the commit, before another save()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        proc.stdout.close()
    assert (tmp_path / "step-000000003").is_dir()  # committed
    saves = [e for e in read_events(tmp_path) if e["event"] == "save"]
    assert sorted(e["step"] for e in saves) == [1, 2, 3], saves
    s2 = next(e for e in saves if e["step"] == 3)
    assert s2["bytes"] > 0 and s2["async_save"] is True and s2["duration_s"] >= 0 and s2["committed_t"] > 0
    assert s2["stall_s"] >= s2["stall_call_s"] >= 0


def test_async_saves_are_logged_exactly_once_with_their_stall(tmp_path):
    model = torch.nn.Linear(16, 16)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(2), keep=tg.KeepLatest(2), async_save=True,
                              handle_signals=False) as mgr:
        for step in range(1, 9):
            mgr.save(step, {"model": model})
            if step == 4:
                mgr.wait()
    saves = [e for e in read_events(tmp_path) if e["event"] == "save"]
    assert sorted(e["step"] for e in saves) == [2, 4, 6, 8], saves
    for e in saves:
        parts = e["stall_call_s"] + e["stall_hook_s"] + e["stall_wait_s"]
        assert abs(e["stall_s"] - parts) < 1e-5, e  # async: the call and the waits for staging, nothing else
        assert e["stall_prev_s"] <= e["stall_call_s"] + 1e-6 and e["duration_s"] >= e["stall_call_s"] - 1e-6, e
    events = list(read_events(tmp_path))
    deletes = [i for i, e in enumerate(events) if e["event"] == "retention_delete"]
    assert deletes
    for i in deletes:  # the save whose retention deleted it is logged before the delete (a kill between keeps it)
        by = events[i]["step"] + 4  # KeepLatest(2) of saves every 2 steps: the commit of step d + 4 deletes step d
        assert any(e["event"] == "save" and e["step"] == by for e in events[:i]), events


def test_export_and_convert_write_the_same_safetensors_metadata_and_tensors(tmp_path):
    from safetensors import safe_open

    from trainguard.convert import convert
    from trainguard.export import export

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    ckpt = tmp_path / "run" / "step-000000007"
    tg.save(ckpt, {"model": model})
    export(ckpt, tmp_path / "e.safetensors")
    convert(ckpt, tmp_path / "c.safetensors")
    got = {}
    for name in ("e", "c"):
        with safe_open(str(tmp_path / f"{name}.safetensors"), "pt") as f:
            got[name] = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert got["e"][0] == got["c"][0] == {"format": "pt", "source": "trainguard", "step": "7"}, got
    assert got["e"][1].keys() == got["c"][1].keys() == model.state_dict().keys()
    assert all(torch.equal(got["e"][1][k], got["c"][1][k]) for k in got["e"][1])


_PLAN = ["--nodes", "4", "--node-failures-per-day", "0.01", "--save-stall", "30s", "--restart", "10m", "--step-time", "2s"]


def test_plan_and_doctor_count_node_hours_for_nodes_without_gpus(tmp_path):
    """A CPU-only job: ``--gpus-per-node 0`` (refused before) says node-hours, never GPU-hours."""
    import json

    from click.testing import CliRunner

    from trainguard.commands.plan import doctor_cmd, plan_cmd

    res = CliRunner().invoke(plan_cmd, [*_PLAN, "--every", "500", "--gpus-per-node", "0"])
    assert res.exit_code == 0, res.output
    assert "node-hours" in res.output, res.output  # the column's header (rich wraps it)
    assert "GPU-hours" not in res.output, res.output
    res = CliRunner().invoke(plan_cmd, [*_PLAN, "--gpus-per-node", "0", "--json"])
    out = json.loads(res.output)
    assert out["gpus_per_node"] == 0 and out["lost_gpu_hours_per_day"] == 0
    assert abs(out["lost_node_hours_per_day"] - (1 - out["efficiency_at_daly"]) * 4 * 24) < 1e-3, out
    default = CliRunner().invoke(plan_cmd, _PLAN)  # not given: the figures say what they assume
    assert default.exit_code == 0 and "GPU-hours assume 8 GPUs per node" in default.output, default.output
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport trainguard as tg\n\ndef trainguard_state():\n"
                      "    m = torch.nn.Linear(2, 2)\n"
                      "    return {'model': m}, {'root': 'ckpt', 'save': tg.EveryNSteps(50000), 'keep': tg.KeepLatest(2)}\n")
    res = CliRunner().invoke(doctor_cmd, [str(script), *_PLAN, "--gpus-per-node", "0", "--json"])
    interval = next(f for f in json.loads(res.stdout.splitlines()[0]) if f["check"] == "interval")
    assert "node-hours/day more lost" in interval["message"] and "GPU" not in interval["message"], interval


def test_convert_to_and_from_dcp_warns_nothing_of_torch_single_process(tmp_path):
    """convert is one process by design (no_dist=True): torch's "torch.distributed is disabled, unavailable
    or uninitialized, assuming the intent is to save/load in a single process" was printed (the CLI shows
    every warning as a `warning:` line: seen with `trainguard convert CKPT out --to dcp --entry '*'`)."""
    import warnings

    from trainguard.convert import DCP_WARNING, convert

    ckpt = tmp_path / "run" / "step-000000003"
    tg.save(ckpt, {"model": torch.nn.Linear(4, 4)})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert convert(ckpt, tmp_path / "dcp", dst_format="dcp", entry=None)["tensors"] == 2
        assert convert(tmp_path / "dcp", tmp_path / "back" / "step-000000000")["tensors"] == 2
    said = [str(w.message) for w in seen]
    assert not [m for m in said if "torch.distributed is" in m], said
    assert DCP_WARNING in said  # trainguard's own warning (DCP metadata is a pickle) stays


def test_the_agents_exit_78_line_says_how_the_other_ranks_ended(capsys):
    """A 3-rank start whose restore was refused (trainguard run --nproc-per-node 3, Linear(4, 5) over a
    Linear(4, 4) checkpoint): ranks 0 and 2 exited 78, torch's agent SIGTERMed rank 1 on its way there; the
    line named "rank(s) [0, 2]" and nothing of rank 1. The failures as torch's agent hands them over."""
    from types import SimpleNamespace

    from trainguard.elastic.stops import PERMANENT_EXIT, agent_result
    from trainguard.events import EventLog

    failures = {0: SimpleNamespace(exitcode=PERMANENT_EXIT, message="StateMismatchError: shapes differ"),
                1: SimpleNamespace(exitcode=-signal.SIGTERM, message=""),
                2: SimpleNamespace(exitcode=PERMANENT_EXIT, message="")}
    assert agent_result(EventLog(None), failures) == PERMANENT_EXIT
    line = capsys.readouterr().err
    assert "rank(s) [0, 2] failed with an error a restart will not fix (exit 78)" in line, line
    assert "rank 1 killed by SIGTERM (the agent stops the other workers once one failed)" in line, line
    assert "not restarted: StateMismatchError: shapes differ" in line, line
    agent_result(EventLog(None), {0: failures[0]})  # alone: as before
    assert "rank 1" not in capsys.readouterr().err
