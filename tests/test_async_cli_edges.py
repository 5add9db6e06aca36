"""Edges of async saves and of the CLI found by a review: a save in flight at interpreter exit,
an interrupted save call, two async managers in one process, an exception in the with-block,
staging memory after close(), and CLI/planner input errors (one line, exit code 2)."""

from __future__ import annotations

import json
import math
import os
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
import trainguard.demo.driver
from trainguard import async_save, faults, stage
from trainguard.cli import main
from trainguard.events import read_events
from trainguard.inspect import list_checkpoints, verify
from trainguard.reliability import make_plan

SRC = Path(tg.__file__).resolve().parents[1]  # the trainguard under test (children import the same one)


@pytest.fixture(autouse=True)
def _own_async_state(monkeypatch):
    """Each test gets its own process-wide staging pools and fault counters; a save it left in
    flight is finished before the next test."""
    monkeypatch.setattr(stage, "_DEFAULT", {})
    monkeypatch.setattr(faults, "_passed", {})
    yield
    job = async_save._INFLIGHT
    if job is not None:
        job.handle.join()


def _crash_at(monkeypatch, point: str) -> None:
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", point)
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(r) -> bool:
    return any(ln.startswith("error:") for ln in r.output.splitlines()) and "Traceback" not in r.output


def _small_model_state() -> dict:
    model = torch.nn.Linear(64, 64)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


# ---------------------------------------------------------------- async saves


CHILD_EXITS_WITH_SAVE_IN_FLIGHT = textwrap.dedent("""
    import sys
    import torch
    import trainguard as tg

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    tg.save(sys.argv[1], state, async_=True)
    print("saved from", tg.__file__)
    # the script ends here: no result(), no wait()
""")


def test_async_save_in_flight_at_interpreter_exit_is_finished(tmp_path, run_child):
    script = tmp_path / "child.py"
    script.write_text(CHILD_EXITS_WITH_SAVE_IN_FLIGHT)
    ckpt = tmp_path / "ck" / "step-000000001"
    r = run_child([str(script), str(ckpt)], env={"PYTHONPATH": str(SRC)}, timeout=120)
    assert str(SRC) in r.stdout, r.stdout + r.stderr  # the child ran the trainguard under test
    assert r.returncode == 0, r.stderr[-3000:]
    res = verify(ckpt)
    assert res.ok, res
    torch.manual_seed(0)
    want = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}
    got = {k: torch.zeros(1024, 1024) for k in want}
    tg.load(ckpt, got)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_interrupted_async_save_call_releases_the_staging_pool(tmp_path, monkeypatch):
    real, calls = async_save.copy_into, []

    def interrupted(slot, src, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while the call copies the state
        return real(slot, src, *args, **kwargs)

    monkeypatch.setattr(async_save, "copy_into", interrupted)
    state = {"x": torch.arange(4096, dtype=torch.float32), "y": torch.ones(1024)}
    with pytest.raises(KeyboardInterrupt):
        tg.save(tmp_path / "a", state, async_=True)
    assert calls == [1]
    assert not stage.default_pool().in_use
    tg.save(tmp_path / "b", state, async_=True).result(timeout=60)  # the next save is not refused
    got = {"x": torch.zeros(4096), "y": torch.zeros(1024)}
    tg.load(tmp_path / "b", got)
    assert torch.equal(got["x"], state["x"]) and torch.equal(got["y"], state["y"])


def test_other_managers_failed_async_save_does_not_skip_this_managers_save(tmp_path, monkeypatch):
    a_root, b_root = tmp_path / "A", tmp_path / "B"
    a_state, b_state = {"w": torch.ones(1000)}, {"ema": torch.full((1000,), 2.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(a_root, save=tg.EveryNSteps(1), async_save=True, on_error="warn",
                                  handle_signals=False) as mgr_a, \
             tg.CheckpointManager(b_root, save=tg.EveryNSteps(1), async_save=True, on_error="warn",
                                  handle_signals=False) as mgr_b:
            _crash_at(monkeypatch, "before_fsync")
            ha = mgr_a.save(1, a_state)
            assert ha is not None
            ha.join()  # A's save failed in the background; nobody has looked at it yet
            assert ha.exception() is not None
            monkeypatch.delenv("TRAINGUARD_CRASH_AT")
            hb = mgr_b.save(1, b_state)  # must not raise/report A's failure as its own
            assert hb is not None, [str(w.message) for w in caught]
            mgr_b.wait()
            b_warnings = [str(w.message) for w in caught if "failed" in str(w.message)]
            mgr_a.wait()
    assert not b_warnings, b_warnings
    assert (b_root / "step-000000001" / "manifest.json").exists()
    assert "step-000000001" in os.listdir(b_root)
    assert mgr_b.latest_step() == 1
    assert not [e for e in read_events(b_root) if e["event"] == "save_failed"]
    # A reports its own failure: a warning and an event in A's log, and A holds no step 1.
    assert any("save of step 1 failed" in str(w.message) for w in caught)
    assert [e["step"] for e in read_events(a_root) if e["event"] == "save_failed"] == [1]
    assert not (a_root / "step-000000001" / "manifest.json").exists()


def test_exception_in_with_block_is_not_replaced_by_failed_async_save(tmp_path, monkeypatch):
    _crash_at(monkeypatch, "before_fsync")
    state = _small_model_state()
    with pytest.raises(ValueError, match="the training loop's own error"):
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
            assert mgr.save(1, state) is not None  # in flight; will fail at before_fsync
            raise ValueError("the training loop's own error")
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "save_failed"] == [1]
    monkeypatch.delenv("TRAINGUARD_CRASH_AT")
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        mgr.save(2, state)  # the lock was released and saving works again
    assert mgr.latest_step() == 2


def test_close_frees_async_staging_memory_and_next_save_allocates_again(tmp_path):
    state = _small_model_state()
    state["big"] = torch.randn(1 << 20)  # 4 MiB plain tensor: copied into the pool in the call
    pool = stage.default_pool()
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True,
                              handle_signals=False) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert pool.capacity >= 4 << 20  # the save staged through this pool
    assert pool.capacity == 0
    assert all(p.capacity == 0 for p in stage._DEFAULT.values())
    h = tg.save(tmp_path / "next", state, async_=True)
    h.result(timeout=60)
    assert verify(tmp_path / "next").ok
    assert not stage.default_pool().in_use


def test_negative_max_staging_bytes_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="max_staging_bytes"):
        tg.CheckpointManager(tmp_path, async_save=True, max_staging_bytes=-1, handle_signals=False)


# ---------------------------------------------------------------- CLI


def test_cli_ls_of_missing_path_or_file_is_a_one_line_error(tmp_path):
    afile = tmp_path / "afile.txt"
    afile.write_text("not a checkpoint")
    for path in (tmp_path / "missing", afile):
        r = _cli("ls", path)
        assert r.exit_code == 2 and _one_line_error(r), (path, r.exit_code, r.output, r.exception)


def test_cli_verify_of_a_file_is_a_one_line_error(tmp_path):
    afile = tmp_path / "afile.txt"
    afile.write_text("not a checkpoint")
    r = _cli("verify", afile)
    assert r.exit_code == 2 and _one_line_error(r), (r.exit_code, r.output, r.exception)


def test_cli_export_into_missing_directory_is_a_one_line_error(tmp_path):
    tg.save(tmp_path / "c", {"model": {"w": torch.ones(4)}})
    r = _cli("export", tmp_path / "c", "--to", "/nonexistent_dir_xyz/x.pt")
    assert r.exit_code == 2 and _one_line_error(r), (r.exit_code, r.output, r.exception)
    assert "/nonexistent_dir_xyz" in r.output


def test_cli_plan_zero_stall_is_a_usage_error_and_json_has_no_nan():
    base = ["plan", "--nodes", "256", "--node-failures-per-day", "0.0065", "--restart", "10m", "--step-time", "2s"]

    def strict(name):
        raise AssertionError(f"plan --json printed {name}")

    for stall, code in (("30s", 0), ("0", 2), ("0s", 2)):
        r = _cli(*base, "--save-stall", stall, "--every", "500,1000", "--json")
        if r.exit_code == 0:  # whatever it prints is strict JSON
            json.loads(r.stdout, parse_constant=strict)
        assert r.exit_code == code, (stall, r.exit_code, r.output)
    r = _cli(*base, "--save-stall", "0")
    assert r.exit_code == 2 and "stall" in r.output and "Traceback" not in r.output
    ok = json.loads(_cli(*base, "--save-stall", "30s", "--json").stdout, parse_constant=strict)
    assert all(math.isfinite(v) for v in ok.values() if isinstance(v, float))


def test_cli_demo_save_every_zero_is_a_usage_error_before_any_worker(monkeypatch):
    started = []
    monkeypatch.setattr(trainguard.demo.driver, "run_demo", lambda **kw: started.append(kw) or {"identical": True})
    r = _cli("demo", "--steps", "10", "--fault-step", "20", "--size", "tiny", "--save-every", "0")
    assert r.exit_code == 2 and "--save-every" in r.output, (r.exit_code, r.output)
    assert started == []


# ---------------------------------------------------------------- planner


def test_make_plan_refuses_a_zero_stall():
    with pytest.raises(ValueError, match="stall_s"):
        make_plan(nodes=8, stall_s=0, restart_s=600, node_failures_per_day=0.01)
    with pytest.raises(ValueError, match="stall_s"):
        make_plan(nodes=8, stall_s=0.0, restart_s=600, node_failures_per_day=0.01, step_time_s=2.0)


def test_make_plan_refuses_an_infinite_node_mtbf():
    with pytest.raises(ValueError, match="node_mtbf_s"):
        make_plan(nodes=8, stall_s=30, restart_s=600, node_mtbf_s=float("inf"))
    with pytest.raises(ValueError, match="node_failures_per_day"):
        make_plan(nodes=8, stall_s=30, restart_s=600, node_failures_per_day=float("inf"))


def test_cli_ls_of_a_step_directory_says_to_use_inspect(tmp_path):
    tg.save(tmp_path / "step-000000001", {"w": torch.ones(4)})
    r = _cli("ls", tmp_path / "step-000000001")
    assert r.exit_code == 2 and _one_line_error(r), (r.exit_code, r.output, r.exception)
    assert "is a checkpoint, not a run directory" in r.output and "trainguard inspect" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("ls", empty)  # a run directory without checkpoints yet is no error
    assert r.exit_code == 0 and "no checkpoints" in r.output


def test_list_checkpoints_of_a_step_directory_raises_instead_of_listing_nothing(tmp_path):
    tg.save(tmp_path / "run" / "step-000000001", {"w": torch.ones(4)})
    assert [(r.step, r.status) for r in list_checkpoints(tmp_path / "run")] == [(1, "valid")]
    with pytest.raises(tg.NotACheckpointError, match="is a checkpoint, not a run directory"):
        list_checkpoints(tmp_path / "run" / "step-000000001")  # returned [] before
    (tmp_path / "empty").mkdir()
    assert list_checkpoints(tmp_path / "empty") == []  # a run directory with no checkpoint yet
    with pytest.raises(tg.NotACheckpointError, match="is a file"):
        list_checkpoints(tmp_path / "run" / "step-000000001" / "manifest.json")


def test_cli_run_of_a_missing_script_is_one_line_before_any_worker(tmp_path, capsys):
    from trainguard.elastic.launcher import main as launch

    rc = launch(["--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), str(tmp_path / "nosuch.py")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "nosuch.py: no such file" in err
    assert not (tmp_path / "run").exists()  # refused before the agent started (no event log)
