"""``trainguard bench DIR``: the figures ``trainguard plan`` needs, measured on real files.

Every run here writes real checkpoints (fsync'd) of a few MiB into a test directory; the figures'
values are the machine's, so the tests check their presence, their relations and what they are
used for (``trainguard plan`` accepts the printed options), not how fast they are.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import selfbench
from trainguard.cli import main as cli

ASYNC = ("async_call_s", "async_step_wait_s", "async_stall_s", "async_duration_s")


def _bench(*args: str):
    return CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)


def test_bench_json_measures_every_figure_and_leaves_nothing(tmp_path):
    res = _bench(str(tmp_path), "--size", "4MiB", "--rounds", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # the rounds' progress lines go to stderr with --json
    assert out["device"] == "cpu" and out["state_bytes"] >= 4 * 2**20 * 0.9 and len(out["rounds"]) == 2
    for fig in [out["first_round"], *out["rounds"]]:
        assert set(fig) == set(selfbench.FIGURES) - {"load_s"}  # local and CPU: raw write, loads cached and not
        assert all(v > 0 for v in fig.values())
        assert fig["async_stall_s"] == pytest.approx(fig["async_step_wait_s"] + fig["async_call_s"], abs=1e-9)
        assert fig["async_duration_s"] >= fig["async_stall_s"]
    s = out["summary"]["sync_save_s"]
    assert s["first"] == out["first_round"]["sync_save_s"]
    assert s["median"] == pytest.approx(sum(r["sync_save_s"] for r in out["rounds"]) / 2)
    assert os.listdir(tmp_path) == []  # both checkpoints and the bench directory removed


def test_printed_plan_options_are_accepted_by_plan(tmp_path):
    res = _bench(str(tmp_path), "--size", "2MiB", "--rounds", "1")
    assert res.exit_code == 0, res.output
    assert "sync save (durable)" in res.output and "load, files not cached" in res.output
    line = next(x for x in res.output.splitlines() if x.startswith("for `trainguard plan`: "))
    flags = shlex.split(line.split(": ", 1)[1].split(" (async)")[0])
    assert flags[0] == "--save-stall" and flags[2] == "--save-duration"
    plan = CliRunner().invoke(cli, ["plan", "--nodes", "64", "--node-mtbf", "200d", "--restart", "5m", *flags, "--json"])
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.output)
    assert planned["stall_s"] == pytest.approx(float(flags[1].rstrip("s")))
    assert planned["commit_delay_s"] == pytest.approx(float(flags[3].rstrip("s")) - planned["stall_s"])


def test_keep_leaves_two_valid_checkpoints_holding_the_state(tmp_path):
    res = _bench(str(tmp_path), "--size", "2MiB", "--rounds", "2", "--keep")
    assert res.exit_code == 0, res.output
    (work,) = tmp_path.iterdir()
    assert work.name.startswith("trainguard-bench-") and sorted(p.name for p in work.iterdir()) == ["async-2", "sync-2"]
    # the kept paths are printed as they are (they were a wildcard: trainguard-bench-*/sync-1 and async-1)
    (line,) = [x for x in res.output.splitlines() if x.startswith("kept: ")]
    assert line == f"kept: {work / 'sync-2'} and {work / 'async-2'}"
    for ck in work.iterdir():
        assert CliRunner().invoke(cli, ["verify", str(ck)]).exit_code == 0
    _, opt = selfbench.build_state(2 * 2**20, "cpu")  # seeded: the state every round saves
    for ck in ("sync-2", "async-2"):  # each round's loads undo the step taken after its async save
        fresh, _ = selfbench.build_state(2 * 2**20, "cpu")
        for t in selfbench.state_tensors(fresh["optim"]):
            t.zero_()
        tg.load(str(work / ck), fresh)
        pairs = zip(selfbench.state_tensors(opt), selfbench.state_tensors(fresh["optim"]), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def test_a_load_that_does_not_restore_the_bytes_fails_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(tg, "load", lambda path, state, **kw: None)  # the tensors stay zeroed
    res = CliRunner().invoke(cli, ["bench", str(tmp_path), "--size", "2MiB", "--rounds", "1"])
    assert res.exit_code == 1
    assert "did not give back the bytes saved" in res.output
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--size", "4x"], "cannot read '4x' as a size"),
    (["--size", "100KB"], "at least 1 MiB"),
    (["--size", "100TB"], "use a smaller --size"),
])
def test_bad_sizes_are_refused_saying_what_to_write(tmp_path, args, message):
    res = _bench(str(tmp_path), *args)
    assert res.exit_code == 2 and message in res.output
    assert os.listdir(tmp_path) == []


def test_missing_directory_and_missing_cuda_are_refused(tmp_path):
    res = _bench(str(tmp_path / "nope"), "--size", "2MiB")
    assert res.exit_code == 2 and "is not a directory: create it" in res.output
    if not torch.cuda.is_available():
        res = _bench(str(tmp_path), "--size", "2MiB", "--device", "cuda")
        assert res.exit_code == 2 and "no CUDA device" in res.output


def test_parse_size_units():
    assert selfbench.parse_size("1GiB") == 2**30
    assert selfbench.parse_size("500MB") == 500 * 10**6
    assert selfbench.parse_size("2e9") == 2 * 10**9
    assert selfbench.parse_size(" 3 g ") == 3 * 10**9


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    (cmd,) = [line[2:] for line in doc.splitlines() if line.startswith("$ trainguard bench ")]
    args = shlex.split(cmd)[2:]
    monkeypatch.chdir(tmp_path)
    (tmp_path / args[0]).mkdir()  # "the directory must exist"
    res = _bench(*args)
    assert res.exit_code == 0, res.output
    assert "for `trainguard plan`: --save-stall " in res.output
    assert os.listdir(tmp_path / args[0]) == []


def test_an_error_while_the_async_save_writes_waits_for_it_then_cleans_up(tmp_path, monkeypatch):
    import threading

    calls: list[dict] = []
    adam_step = torch.optim.Adam.step

    def step(self, closure=None):  # replaces Adam.step (and the pre-step hook with it): fails right after the call
        if calls and calls[-1].get("async_"):
            raise RuntimeError("the loop failed")
        return adam_step(self, closure)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    real_save = tg.save
    monkeypatch.setattr(tg, "save", lambda *a, **kw: calls.append(kw) or real_save(*a, **kw))
    with pytest.raises(RuntimeError, match="the loop failed"):
        selfbench.run(str(tmp_path), 8 * 2**20, rounds=1)
    assert [kw.get("async_") for kw in calls] == [None, True]  # it failed while the async save was in flight
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "trainguard-async-save"]


def test_under_torchrun_every_rank_saves_its_own_state_at_once(tmp_path):
    """Two ranks under torchrun's elastic agent (gloo, 127.0.0.1): one table, from rank 0, of the
    slower rank's figures; the kept checkpoint holds both ranks' layers (``split_state``), and one
    process without a process group loads each rank's weights back from it."""
    from conftest import free_port, run_py

    port = free_port()
    r = run_py(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--max-restarts", "0", "-m", "trainguard.cli", "bench", str(tmp_path),
                "--size", "2MiB", "--rounds", "1", "--keep", "--json"],
               env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)  # rank 1 prints nothing
    assert out["world"] == 2 and set(out["rounds"][0]) == set(selfbench.FIGURES) - {"load_s"}
    (work,) = tmp_path.iterdir()
    assert sorted(p.name for p in work.iterdir()) == ["async-1", "sync-1"]  # the raw files are gone
    assert out["kept"] == [str(work / "sync-1"), str(work / "async-1")]
    ranks = [selfbench.build_state(2 * 2**20, "cpu", rank)[0]["model"] for rank in (0, 1)]
    both = torch.nn.ModuleDict({k: torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
                                for m in ranks for k, layer in m.items()})
    assert not any(torch.equal(both[k].weight, m[k].weight) for m in ranks for k in m)
    tg.load(str(work / "sync-1"), {"model": both}, only=["model"])
    assert len(both) == 8 and all(torch.equal(both[k].weight, m[k].weight) for m in ranks for k in m)


def _interrupt_raw_write(monkeypatch):
    """Ctrl-C while the raw write's second writer is in its first ``pwrite``: SIGINT sent to the
    main thread (as a terminal's Ctrl-C lands there, waiting in join()), that writer held in its
    write until the main thread's handler has raised KeyboardInterrupt. No timing: events only."""
    import signal
    import threading

    main, got, sent, real = threading.main_thread().ident, threading.Event(), [], os.pwrite

    def pwrite(fd, data, offset):
        if not sent and offset > 0 and "/raw-" in os.readlink(f"/proc/self/fd/{fd}"):
            sent.append(fd)
            signal.pthread_kill(main, signal.SIGINT)
            assert got.wait(60)
        return real(fd, data, offset)

    def on_sigint(signum, frame):
        got.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(selfbench, "_STOP_WAIT_S", 60.0, raising=False)
    old = signal.signal(signal.SIGINT, on_sigint)
    return lambda: signal.signal(signal.SIGINT, old)


def _writers():
    import threading

    return [t for t in threading.enumerate() if t.name == "trainguard-bench-raw-write"]


def test_ctrl_c_during_the_raw_write_stops_the_writers_before_releasing_the_buffer(tmp_path, monkeypatch):
    """It raised BufferError (the buffer closed under a writer) in place of the KeyboardInterrupt."""
    fds = len(os.listdir("/proc/self/fd"))
    restore = _interrupt_raw_write(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            selfbench._raw_write(str(tmp_path), 8 * 2**20, torch.randn(1024), "raw-0.bin")
    finally:
        restore()
    assert os.listdir(tmp_path) == [] and not _writers()
    assert len(os.listdir("/proc/self/fd")) == fds  # the file closed once its writers stopped


def test_ctrl_c_exits_130_and_removes_the_files_or_names_what_keep_left(tmp_path, monkeypatch):
    restore = _interrupt_raw_write(monkeypatch)
    try:
        res = _bench(str(tmp_path), "--size", "8MiB", "--rounds", "1")
    finally:
        restore()
    assert res.exit_code == 130 and "interrupted: its files are removed" in res.stderr
    assert os.listdir(tmp_path) == [] and not _writers()
    monkeypatch.undo()
    real_load = tg.load

    def load(path, state, **kw):  # Ctrl-C during the first round's second load: both checkpoints written
        if load.calls:
            raise KeyboardInterrupt
        load.calls += 1
        return real_load(path, state, **kw)

    load.calls = 0
    monkeypatch.setattr(tg, "load", load)
    res = _bench(str(tmp_path), "--size", "2MiB", "--rounds", "1", "--keep")
    assert res.exit_code == 130, res.output
    (work,) = tmp_path.iterdir()
    assert res.stderr.strip() == f"interrupted: left {work / 'async-0'}, {work / 'sync-0'}"


def test_a_raw_write_error_is_raised_as_itself(tmp_path, monkeypatch):
    """A full disk (or O_DIRECT refused at write) in a writer: its traceback kept the writer's view
    of the buffer, whose close then raised BufferError in place of the OSError."""
    import errno

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"):
        selfbench._raw_write(str(tmp_path), 8 * 2**20, torch.randn(1024), "raw-0.bin")
    assert os.listdir(tmp_path) == [] and not _writers()


def test_one_round_gives_the_plan_options_of_a_measured_round_not_of_the_first(tmp_path, monkeypatch):
    """--rounds 1 gave the options of the only round, the first (a new staging buffer faulted in):
    now a first round comes before the measured ones, shown apart."""
    saves: list[str] = []
    real_save = tg.save
    monkeypatch.setattr(tg, "save", lambda path, *a, **kw: saves.append(os.path.basename(path)) or real_save(path, *a, **kw))
    res = _bench(str(tmp_path), "--size", "2MiB", "--rounds", "1", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert saves == ["sync-0", "async-0", "sync-1", "async-1"] and len(out["rounds"]) == 1
    first, (measured,) = out["first_round"], out["rounds"]
    assert set(first) == set(measured) and out["summary"]["async_stall_s"]["first"] == first["async_stall_s"]
    assert out["plan_flags"] == (f"--save-stall {measured['async_stall_s']:.3g}s --save-duration "
                                 f"{measured['async_duration_s']:.3g}s (async) or --save-stall "
                                 f"{measured['sync_save_s']:.3g}s (sync)")
    assert "first round (not in the medians): " in res.stderr and "round 1/1: " in res.stderr


@pytest.mark.parametrize("size", ["1e400", "9" * 400, "-1GiB", "0", "0.5MiB", "nan", "inf", "1e-4GiB", "", "2e18"])
def test_every_invalid_size_is_a_usage_error_saying_what_to_write(tmp_path, size):
    """1e400 raised OverflowError (a traceback); each one is one `error:` line, exit 2."""
    res = CliRunner().invoke(cli, ["bench", str(tmp_path), "--size", size])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: Invalid value for '--size': ") and "e.g. " in line and "bench [OPTIONS] DIRECTORY" in line
    assert os.listdir(tmp_path) == []


def test_a_size_beyond_the_free_memory_says_so(tmp_path):
    res = _bench(str(tmp_path), "--size", "1e15")
    assert res.exit_code == 2 and "of free memory" in res.stderr and "use a smaller --size" in res.stderr


def test_o_direct_refused_at_the_first_write_is_written_again_buffered(tmp_path, monkeypatch):
    """Some devices take O_DIRECT at open and refuse the first write (EINVAL), as tg.save's own
    writer knows (storage/local.py): the raw write failed, and with it the whole bench."""
    import errno
    import fcntl

    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        calls.append(direct)
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    assert selfbench._raw_write(str(tmp_path), 8 * 2**20, torch.randn(1024), "raw-0.bin") > 0
    if not any(calls):
        pytest.skip("this file system refuses O_DIRECT at open: nothing refused at the first write")
    assert calls.count(False) >= 2 and os.listdir(tmp_path) == [] and not _writers()
