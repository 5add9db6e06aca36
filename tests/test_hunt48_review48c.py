"""review48c: fresh-eyes review of the elastic runner, planning and CLI (session 48)."""

from __future__ import annotations

import pytest

SCRIPT = "import os\nprint('trained', os.environ['RANK'], flush=True)\n"


@pytest.mark.parametrize("bad,says", [
    # torchrun refuses an item without a value; trainguard's c10d defaults merge dropped it silently
    # (the job ran with torch's join timeout, not the one meant: `join_timeout:900` is a typo of `=`)
    (["--rdzv-conf", "join_timeout:900"], "--rdzv-conf"),
    (["--rdzv-conf", "last_call_timeout=5,"], "--rdzv-conf"),
    # these reached torch's config_from_args after the run directory and agent_start: a traceback, exit 1
    (["--nnodes", "2:1"], "--nnodes"),
    (["--nnodes", "0"], "--nnodes"),
    (["--nnodes", "1:2:3"], "--nnodes"),
    (["--nnodes", "x"], "--nnodes"),
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--nproc-per-node", "foo"], "--nproc-per-node"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
])
def test_run_refuses_bad_launcher_arguments_before_starting(tmp_path, capsys, bad, says):
    """``trainguard run``'s main with launcher arguments torchrun refuses: one ``error:`` line, exit 2,
    before the run directory (and its agent_start event) exists and before any worker runs. The
    old code ran the job (--rdzv-conf) or raised torch's AssertionError/ValueError from run()."""
    from trainguard.elastic.launcher import main

    (tmp_path / "t.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--nproc-per-node", "1", *bad, "--run-dir", str(run_dir), str(tmp_path / "t.py")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], err
    assert not run_dir.exists()


def test_run_still_accepts_what_torchrun_accepts():
    """Spaces around an --rdzv-conf key and value, --nnodes N and MIN:MAX, --max-restarts 0, cpu: no refusal."""
    from trainguard.elastic.args import check
    from trainguard.elastic.launcher import build_parser

    for argv in (["--rdzv-conf", " join_timeout = 60 ,is_host=false", "--nnodes", "1:4", "--max-restarts", "0"],
                 ["--nnodes", "3", "--nproc-per-node", "cpu", "--rdzv-conf", ""]):
        check(build_parser().parse_args([*argv, "t.py"]))


HANG_SCRIPT = """
import os, torch, trainguard as tg
import torch.distributed as dist
dist.init_process_group("gloo")
with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(1000), handle_signals=False) as mgr:
    for step in range(20):
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits here for rank 1, which hangs in its heartbeat of step 3
        mgr.save(step, {"progress": tg.StateDict(step=step)})
"""


@pytest.mark.slow  # ~20 s on this loaded machine: test_agent_names_the_hung_rank_from_the_notes is the quick one
@pytest.mark.parametrize("run_path", [False, True])
def test_a_hang_is_blamed_on_the_hung_rank_not_on_the_peer_waiting_for_it(tmp_path, run_child, run_path):
    """Rank 1 hangs; rank 0 blocks in all_reduce waiting for it. Both watchdogs fire within ms of each
    other (both last beat at step 3) and both exit 75: the agent named rank 0 ("#1 rank 0 hang")."""
    import json

    (tmp_path / "hang.py").write_text(HANG_SCRIPT)
    run_dir = tmp_path / "run"
    argv = ["-m", "trainguard", "run", "--nproc-per-node", "2", "--max-restarts", "0", "--hang-timeout", "3",
            "--fault", "step=3,rank=1,kind=hang", "--run-dir", str(run_dir),
            *(["--run-path", "--start-method", "fork"] if run_path else []), str(tmp_path / "hang.py")]
    p = run_child(argv, timeout=150)
    assert p.returncode == 1, p.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failure = next(e for e in events if e["event"] == "failure")
    # "killed by SIGTERM" when the agent looked after rank 0's watchdog fired and before rank 1's did
    assert failure["rank"] == 1 and failure["cause"] in ("hang (watchdog)", "killed by SIGTERM"), failure
    hangs = {e["rank"]: e for e in events if e["event"] == "hang"}
    assert hangs.get(1, {"waiting_in": None})["waiting_in"] is None  # its own hang (the drill's sleep)
    if 0 in hangs:  # the peer's watchdog fired too (not when torch ended it first): it waited in all_reduce
        assert hangs[0]["waiting_in"] == "all_reduce", hangs[0]["stacks"][-2000:]
    assert not list((run_dir / ".trainguard").glob("*.hang-*"))  # the notes are read and removed


class _Failure:
    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode


class _Proc:
    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode


def test_agent_names_the_hung_rank_from_the_notes(tmp_path, monkeypatch):
    """The agent's side of the above, with the notes two watchdogs leave (hangnote.record's files):
    rank 0 waited in all_reduce, rank 1 did not. Script workers (first_failure) and --run-path
    workers (root_failure) both name rank 1, also when the agent stopped rank 1 before its own
    watchdog fired (SIGTERM); with no notes (plain torchrun) or both waiting, rank 0 as before."""
    from torch.multiprocessing.spawn import ProcessExitedException

    from trainguard.elastic import stops

    stop = tmp_path / ".trainguard" / "stopped-host-1"
    stop.parent.mkdir()
    monkeypatch.setenv("TRAINGUARD_STOP_FILE", str(stop))

    def notes(rank0: str, rank1: str | None) -> None:
        (tmp_path / ".trainguard" / "stopped-host-1.hang-4000").write_text(rank0)
        if rank1 is not None:
            (tmp_path / ".trainguard" / "stopped-host-1.hang-4001").write_text(rank1)

    hung = {0: _Failure(4000, 75), 1: _Failure(4001, 75)}
    notes("all_reduce", "")
    assert stops.first_failure(hung) == 1
    assert not list(stop.parent.glob("*.hang-*"))  # read and removed
    assert stops.first_failure(hung) == 0  # no notes: as before
    notes("all_reduce", "barrier")
    assert stops.first_failure(hung) == 0  # both waited: no telling, the lowest
    stopped = {0: _Failure(4000, 75), 1: _Failure(4001, -15)}  # rank 1 ended by the agent before its watchdog fired
    monkeypatch.setattr(stops, "AGENT_STOPPED", {4001})
    notes("all_reduce", None)
    assert stops.first_failure(stopped) == 1
    assert stops.first_failure(stopped) == 0  # no notes: the agent's own stop is no cause, as before

    class PC:
        processes = [_Proc(4000, 75), _Proc(4001, 75)]

    notes("all_reduce", "")
    reported = ProcessExitedException("process 0 terminated with exit code 75", error_index=0, error_pid=4000, exit_code=75)
    cause = stops.root_failure(PC(), reported)
    assert cause is not reported and cause.error_index == 1 and cause.exit_code == 75
    notes("", "")
    assert stops.root_failure(PC(), reported) is reported
    PC.processes = [_Proc(4000, 75), _Proc(4001, -15)]
    notes("all_reduce", None)
    cause = stops.root_failure(PC(), reported)
    assert cause is not reported and cause.error_index == 1 and cause.exit_code == -15
    notes("all_reduce", "")
    stops.clear(str(stop))  # a restart's rendezvous: the notes of the last attempt go
    assert not list(stop.parent.glob("*.hang-*"))
