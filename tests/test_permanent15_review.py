"""Review: an error a restart will not fix must not be restarted (docs/elastic.md, "Exit codes for
a requeue wrapper"). Before, a worker failing with such an error (the script's model no longer
fits the checkpoint, every checkpoint corrupt, the run directory a file, another live job's lock,
a bad argument) was restarted ``--max-restarts`` times by ``trainguard run`` (22 s here for a
state that does not fit) and the job exited 1, like a crash a restart may fix: a requeue wrapper
then started it again and again. Now such errors are marked permanent, a process dying of one
exits 78 (EX_CONFIG), and the agent restarts no worker that exited 78 and exits 78 itself."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_elastic_edges import CLI
from test_exitcodes15_review import ROOT, _env, _events, _run
from trainguard.elastic import stops
from trainguard.permanent import PERMANENT_EXIT, is_permanent

# Restores a Linear(4, argv[1]) (the checkpoint holds a Linear(4, 4)), one all-reduce, one save.
WORKER = """\
    import os, sys
    import torch
    import torch.distributed as dist
    import trainguard as tg

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, int(sys.argv[1]))
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(1)) as mgr:
        step = mgr.restore({"model": model}) or 0
        for step in range(step + 1, step + 3):
            dist.all_reduce(torch.zeros(1))
            mgr.save(step, {"model": model})
    print(f"rank {dist.get_rank()} ended at step {step} ", flush=True)
"""


def _checkpoint(run: Path) -> None:
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(4, 4)})


def _agent(tmp_path: Path, width: int, *flags: str) -> list[str]:
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(WORKER))
    return [*CLI, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), *flags, str(train), str(width)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [(), pytest.param(("--start-method", "fork", "--run-path"), marks=pytest.mark.slow)],
                         ids=["subprocess", "run-path"])  # run-path: make test-slow
def test_a_state_that_does_not_fit_ends_the_job_with_78_without_a_restart(tmp_path: Path, flags: tuple) -> None:
    """Before: exit 1 after 3 restarts (every attempt failed the same way). Now: 78 at once, an
    ``agent_exit`` with ``permanent: true``, and one line saying what to change."""
    _checkpoint(tmp_path / "run")
    log = tmp_path / "agent.log"
    rc = _run(_agent(tmp_path, 5, *flags), log)
    text = log.read_text(errors="replace")
    assert rc == PERMANENT_EXIT, text[-3000:]
    assert not _events(tmp_path / "run", "restart"), text[-3000:]
    exits = _events(tmp_path / "run", "agent_exit")
    assert exits[-1]["permanent"] is True and exits[-1]["ok"] is False, exits
    line = [x for x in text.splitlines() if x.startswith("trainguard run: rank(s)")]
    assert len(line) == 1 and "a restart will not fix" in line[0] and "Pass strict=False" in line[0], text[-3000:]
    assert tg.CheckpointManager(tmp_path / "run").latest_step() == 1  # nothing was saved over it


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["kill", pytest.param("exception", marks=pytest.mark.slow)])  # exception: make test-slow
def test_a_transient_failure_is_still_restarted(tmp_path: Path, kind: str) -> None:
    """Guard: a worker SIGKILLed, or raising an error of its own (a drill's InjectedFault, through
    the --run-path runner), is no permanent failure: restarted once, the job ends 0."""
    _checkpoint(tmp_path / "run")
    log = tmp_path / "agent.log"
    rc = _run(_agent(tmp_path, 4, "--fault", f"step=2,rank=1,kind={kind}", "--start-method", "fork", "--run-path"), log)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert len(_events(tmp_path / "run", "restart")) == 1, text[-3000:]
    assert "permanent" not in _events(tmp_path / "run", "agent_exit")[-1]


def test_agent_result_of_a_worker_that_exited_78(tmp_path: Path) -> None:
    """The agent's verdict: 78 for any worker that exited 78 (others killed by its SIGTERM)."""
    class Failure:
        def __init__(self, code: int, message: str = "") -> None:
            self.exitcode, self.message = code, message

    class Events:
        def __init__(self) -> None:
            self.seen: list[tuple[str, dict]] = []

        def emit(self, kind: str, **kw: object) -> None:
            self.seen.append((kind, kw))

    ev = Events()
    failures = {0: Failure(-15), 1: Failure(78, {"message": "StateMismatchError: fix it"})}  # type: ignore[arg-type]
    assert stops.no_restart(failures) and not stops.no_restart({0: Failure(1), 1: Failure(-9)})
    assert stops.agent_result(ev, failures) == 78
    assert ev.seen == [("agent_exit", {"ok": False, "permanent": True, "ranks": [1], "error": "StateMismatchError: fix it"})]
    assert stops.agent_result(Events(), {0: Failure(1)}) is None


def test_which_errors_are_permanent(tmp_path: Path) -> None:
    """Bad arguments and a state that does not fit are; a plain crash, or one raised while
    handling a permanent error without ``from``, is not."""
    for bad in (lambda: tg.CheckpointManager(tmp_path / "a", layout="x"),
                lambda: tg.CheckpointManager(tmp_path / "a", save=100)):
        with pytest.raises((ValueError, TypeError)) as e:
            bad()
        assert tg.exit_code_for(e.value) == 78
    _checkpoint(tmp_path / "run")
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        with pytest.raises(ValueError) as e:
            mgr.save(-1, {"x": 1})
        assert tg.exit_code_for(e.value) == 78
        with pytest.raises(tg.StateMismatchError) as e:
            mgr.restore({"model": torch.nn.Linear(4, 5)})
        assert tg.exit_code_for(e.value) == 78
        try:
            raise RuntimeError("restore failed") from e.value
        except RuntimeError as wrapped:
            assert tg.exit_code_for(wrapped) == 78
    assert tg.exit_code_for(RuntimeError("boom")) == 1 and tg.exit_code_for(None) == 0
    assert tg.exit_code_for(tg.CheckpointError("x")) == 1 and tg.exit_code_for(OSError(errno.ENOSPC, "full")) == 1


def _corrupt_all(run: Path) -> None:
    for data in run.glob("step-*/data-*"):
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))


def test_every_checkpoint_corrupt_is_permanent_but_not_after_a_medium_error(tmp_path: Path, monkeypatch) -> None:
    """'none of the checkpoints could be loaded' is read again at every restart: permanent. When a
    skip was a medium's read error (EIO: a flaky disk may read it next time), it is not."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": torch.full((64,), float(s))})
    _corrupt_all(run)
    with tg.CheckpointManager(run, handle_signals=False) as mgr, pytest.raises(tg.CheckpointError) as e:
        mgr.restore({"w": torch.zeros(64)})
    assert "none of the 2" in str(e.value) and is_permanent(e.value)
    orig = os.open

    def failing(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if "step-000000002/data-" in str(path):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return orig(path, *a, **kw)

    monkeypatch.setattr(os, "open", failing)
    with tg.CheckpointManager(run, handle_signals=False) as mgr, pytest.raises(tg.CheckpointError) as e:
        mgr.restore({"w": torch.zeros(64)})
    assert "none of the 2" in str(e.value) and not is_permanent(e.value), str(e.value)


def test_an_unusable_run_directory_is_permanent(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(tg.CheckpointError) as e:
        tg.CheckpointManager(tmp_path / "file", handle_signals=False).open()
    assert tg.exit_code_for(e.value) == 78
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False), pytest.raises(tg.LockedError) as e:
        tg.CheckpointManager(tmp_path / "run", handle_signals=False).open()  # the same process
    assert tg.exit_code_for(e.value) == 78


def test_a_lock_held_by_a_live_job_here_is_permanent_one_of_another_host_not(tmp_path: Path) -> None:
    """The holder, a live process of this host: permanent. The holder recorded on another host (a
    lost node's lock on NFS may linger until its lease ends): retried as before."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainguard.runlock import RunLock; "
         f"RunLock({str(run)!r}).acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(tg.LockedError) as e:
            tg.CheckpointManager(run, handle_signals=False).open()
        assert tg.exit_code_for(e.value) == 78
        info = json.loads((run / ".lock").read_text())
        fd = os.open(run / ".lock", os.O_RDWR)
        try:
            os.pwrite(fd, json.dumps({**info, "host": "elsewhere"}).encode().ljust(200), 0)
        finally:
            os.close(fd)
        with pytest.raises(tg.LockedError) as e:
            tg.CheckpointManager(run, handle_signals=False).open()
        assert tg.exit_code_for(e.value) == 1
    finally:
        holder.communicate(b"", timeout=30)


SCRIPT = """\
    import sys, torch, trainguard as tg
    with tg.CheckpointManager(sys.argv[1], handle_signals=False) as mgr:
        mgr.restore({"model": torch.nn.Linear(4, 5)})
"""


@pytest.mark.parametrize("how", ["excepthook", "exit_code_for"])
def test_the_exit_code_of_a_process(tmp_path: Path, how: str) -> None:
    """A worker of ``trainguard run`` (the agent's pid in its environment) dying of the error:
    78 through trainguard's excepthook, after the traceback. Plain python: the documented
    ``sys.exit(tg.exit_code_for(e))``; without either, Python's 1."""
    _checkpoint(tmp_path / "run")
    script = tmp_path / "s.py"
    body = textwrap.dedent(SCRIPT)
    if how == "exit_code_for":
        body = "import sys, traceback, trainguard as tg\ntry:\n" + textwrap.indent(body, "    ") + (
            "except Exception as e:\n    traceback.print_exc()\n    sys.exit(tg.exit_code_for(e))\n")
    script.write_text(body)
    env = {k: v for k, v in _env().items() if k != "TRAINGUARD_AGENT_PID"}
    plain = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True, timeout=60)
    assert plain.returncode == (78 if how == "exit_code_for" else 1), plain.stderr[-2000:]
    if how == "excepthook":
        env["TRAINGUARD_AGENT_PID"] = str(os.getpid())
        p = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True, timeout=60)
        assert p.returncode == 78, p.stderr[-2000:]
        assert b"Traceback" in p.stderr and b"a restart will not fix this error; exit 78" in p.stderr


def test_the_requeue_wrapper_stops_at_78(tmp_path: Path) -> None:
    """examples/requeue.sh: exit 78 is given up at once (before: started 3 times)."""
    count = tmp_path / "count"
    cmd = f"echo x >> {count}; exit 78"
    p = subprocess.run(["bash", str(ROOT / "examples" / "requeue.sh"), "bash", "-c", cmd],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 78, p.stdout
    assert count.read_text().count("x") == 1, p.stdout
    assert "restart will not fix" in p.stdout


@pytest.mark.filterwarnings("ignore:.*belong to no nn.Module")
def test_a_sampler_or_optimizer_built_another_way_is_permanent(tmp_path: Path) -> None:
    """An entry's own check refusing the saved state (a sampler over another dataset size, an
    optimizer with other parameter groups) fails the same at every restart."""
    model = torch.nn.Linear(4, 4)
    data = list(range(10))
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"opt": torch.optim.SGD(model.parameters(), lr=0.1), "sampler": tg.ResumableSampler(data)})
    for state in ({"sampler": tg.ResumableSampler(list(range(11)))},
                  {"opt": torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)}):
        with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr, pytest.raises(tg.CheckpointError) as e:
            mgr.restore(state, strict=False)
        assert tg.exit_code_for(e.value) == 78, str(e.value)


SAVE_WORKER = """\
    import os
    import torch
    import torch.distributed as dist
    import trainguard as tg

    dist.init_process_group("gloo")
    state = {"w": torch.zeros(3), "extra": object() if dist.get_rank() == 1 else 1}
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(1)) as mgr:
        mgr.save(1, state)
"""


@pytest.mark.timeout(150)
def test_a_value_one_rank_cannot_save_ends_every_rank_with_78(tmp_path: Path) -> None:
    """Rank 1's state holds an object (UnsupportedValueError, permanent); the save's first round
    makes every rank raise the same RankFailureError. Before: that error was not permanent on
    any rank (exit 1 everywhere, 3 restarts, exit 1). Now the round carries the mark: 78, no
    restart, and the agent's line ends with rank 1's error, which says what to change."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(SAVE_WORKER))
    log = tmp_path / "agent.log"
    rc = _run([*CLI, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(train)], log)
    text = log.read_text(errors="replace")
    assert rc == PERMANENT_EXIT, text[-3000:]
    assert not _events(tmp_path / "run", "restart"), text[-3000:]
    line = [x for x in text.splitlines() if x.startswith("trainguard run: rank(s)")]
    assert len(line) == 1 and "UnsupportedValueError: extra" in line[0], text[-3000:]


def test_a_lock_recorded_by_a_pid_that_started_later_is_no_live_holder(tmp_path: Path) -> None:
    """A pod restarted under the same host name finds its predecessor's lock still held on NFS (the
    lease has not ended), recorded with a pid that exists again (pid 1, or its own): not permanent,
    the lock may be free at the next start. Here: the holder's record names this process, which
    started after the recorded time."""
    from trainguard.runlock import _live_here

    lock = tmp_path / "lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": 1000.0}))
    fd = os.open(lock, os.O_RDONLY)
    try:
        assert not _live_here(fd)
    finally:
        os.close(fd)
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": 4e9}))
    fd = os.open(lock, os.O_RDONLY)
    try:
        assert _live_here(fd)
    finally:
        os.close(fd)


def test_the_excepthooks_exit_keeps_what_the_script_wrote_to_an_open_file(tmp_path: Path) -> None:
    """The hook ends the process with os._exit(78) (Python's status after an uncaught exception
    is always 1), which skips the flush of files still open at exit. A metrics file the script
    never closed lost its last lines. Now the buffers of open files are flushed first."""
    _checkpoint(tmp_path / "run")
    script = tmp_path / "s.py"
    script.write_text("import sys\nlog = open(sys.argv[2], 'w')\nlog.write('before the error\\n')\n"
                      + textwrap.dedent(SCRIPT))
    env = {**_env(), "TRAINGUARD_AGENT_PID": str(os.getpid())}
    out = tmp_path / "metrics.txt"
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(out)], env=env, capture_output=True, timeout=60)
    assert p.returncode == 78, p.stderr[-2000:]
    assert out.read_text() == "before the error\n"
