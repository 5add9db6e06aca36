"""Review of ``trainguard run`` across nodes (exit codes, docs/elastic.md) and of process cleanup.

Two agents on this machine stand for two nodes (``--nnodes 2``, c10d on 127.0.0.1 through a
store the test hosts, one worker each). Every process group a test starts is bounded in time
and SIGKILLed by its group id in a ``finally``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[int]:
    """Wait for every process (own session each), bounded; whatever is left is SIGKILLed by group."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("did not end in time\n" + "\n=====\n".join(x.read_text(errors="replace")[-3000:] for x in logs))
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


# Two ranks of an env:// gloo group: rank 0's process hosts the c10d store (as under torchrun and
# trainguard run). One sync save, then close(); rank 0 exits at once after its close(). Rank 1
# reads the save's "commit" outcome only when rank 0's process is gone or rank 0 is inside its
# close() (its "at" key: the slower peer of a real job, made certain here).
LAST_SAVE = """\
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    import trainguard as tg
    from trainguard import dist as tgdist

    rank, out = int(os.environ["RANK"]), sys.argv[1]
    dist.init_process_group("gloo")
    if rank == 0:
        open(os.path.join(out, "rank0.pid"), "w").write(str(os.getpid()))
    else:
        orig = tgdist.StoreDistContext.broadcast

        def late(self, tag, value=None, *, timeout=None):
            if tag == "commit":
                pid = int(open(os.path.join(out, "rank0.pid")).read())
                for _ in range(2000):  # bounded: 20 s
                    if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                        break
                    try:
                        if json.loads(self.store.raw.get(f"{self.chan}/at/0"))[2] == "close":
                            break
                    except Exception:
                        pass
                    time.sleep(0.01)
            return orig(self, tag, value, timeout=timeout)

        tgdist.StoreDistContext.broadcast = late
    model = torch.nn.Linear(2, 2)
    mgr = tg.CheckpointManager(os.path.join(out, "ck"), save=tg.EveryNSteps(10**6))
    with mgr:
        mgr.save(1, {"model": model}, force=True)
    print(f"rank {rank} closed", flush=True)
    os._exit(0)
"""


@pytest.mark.timeout(90)
def test_rank0_stays_in_close_until_every_rank_read_the_last_commit(tmp_path: Path) -> None:
    """Before: rank 0 published the last save's commit outcome and left ``close()``; its process
    (the host of the job's c10d store) exited, and a peer that had not read the outcome yet failed
    with ``RankFailureError: commit: the c10d store stopped answering``. Across two nodes that was
    a node whose workers saved on SIGTERM and exited 143 while the other node's worker failed
    (exit 1): one agent exited 143, the other restarted into a closed rendezvous and exited 1."""
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(LAST_SAVE))
    port = str(free_port())
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    (tmp_path / "rank0.pid").write_text("0")  # rank 1 reads it only in the last save
    procs = []
    for r in range(2):
        env = _env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(logs[r], "wb") as f:
            procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=f,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True))
    codes = _wait_all(procs, logs, 80)
    text = "\n=====\n".join(x.read_text(errors="replace")[-3000:] for x in logs)
    assert codes == [0, 0], text
    assert "rank 1 closed" in text and "stopped answering" not in text, text


# One --run-path worker with a DataLoader of 2 processes; each loader process notes its pid.
LOADER = """\
    import os, sys
    import torch
    from trainguard.elastic import heartbeat

    out = sys.argv[1]

    def note(i):
        open(os.path.join(out, f"loader-{os.getpid()}"), "w").close()

    class Zeros(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            return torch.zeros(2)

    for step, batch in enumerate(torch.utils.data.DataLoader(Zeros(), batch_size=4, num_workers=2, worker_init_fn=note), 1):
        heartbeat(step)  # the drill SIGKILLs the worker at step 3
        if step >= 10**4:
            break
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_no_dataloader_process_of_a_killed_worker_outlives_the_agent(tmp_path: Path) -> None:
    """Before: a SIGKILLed ``--run-path`` worker's DataLoader processes (reparented to pid 1) lived
    on after the agent had exited (torch's loader watchdog ends them within ~5 s; they hold the
    agent's stdout open meanwhile: a wrapper reading it waited). The agent stopped only the worker
    pid. Now each worker leads its own process group and the agent ends the group after the worker."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOADER))
    log = tmp_path / "agent.log"
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "1",
           "--start-method", "fork", "--run-path", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
           "--fault", "step=3,rank=0,kind=kill", str(script), str(tmp_path)]
    with open(log, "wb") as f:
        agent = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    loaders: list[int] = []
    try:
        rc = agent.wait(timeout=80)
        loaders = [int(p.name.split("-")[1]) for p in tmp_path.glob("loader-*")]
        left = [pid for pid in loaders if _alive(pid)]  # at once: the agent has just exited
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
        for pid in loaders:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=10)
    text = log.read_text(errors="replace")
    assert rc == 1 and "killed by SIGKILL" in (tmp_path / "run" / "events.jsonl").read_text(), text[-3000:]
    assert len(loaders) == 2, text[-3000:]
    assert left == [], f"loader processes {left} outlived the agent"


# The agent's signal handler (install_signal_once), inherited by a child forked from the agent
# (a worker with --start-method fork) that gets SIGTERM before it installs its own handler, inside
# code that swallows exceptions (as fork's at-fork hooks do: "Exception ignored in _releaseLock").
INHERITED = """\
    import os, signal
    from trainguard.elastic.launcher import install_signal_once

    install_signal_once()
    from torch.distributed.elastic.multiprocessing import api
    signal.signal(signal.SIGTERM, api._terminate_process_handler)  # as torch's PContext.start does
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
        except BaseException:
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("signal" if os.WIFSIGNALED(status) else "exit", os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


def test_a_forked_worker_dies_of_a_stop_signal_its_inherited_handler_got(tmp_path: Path) -> None:
    """Before: a worker forked from the agent kept torch's agent handler, which *raises*
    ``SignalException``; a SIGTERM that reached the worker right after the fork was raised inside
    fork's at-fork hooks, where Python ignores exceptions, and the worker trained on: the agent's
    shutdown waited the full 30 s for its SIGKILL (seen once in 5 runs: worker SIGKILLed, SIGTERM
    to the agent's group 0.5 s after the restart: 36.7 s instead of ~2 s). Now the inherited
    handler ends the process by the signal (default action), whatever code it runs."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent(INHERITED))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["signal", str(int(signal.SIGTERM))], (res.stdout, res.stderr[-2000:])


@pytest.mark.parametrize(("code", "traceback_kept"), [(143, False), (130, False), (1, True), (-9, True)])
def test_the_agent_logs_a_workers_stop_exit_without_a_traceback(code: int, traceback_kept: bool) -> None:
    """Before: with ``--run-path`` torch's agent logged a worker's exit 143 (it saved on SIGTERM and
    stopped, a preemption) with the ``ProcessExitedException`` traceback of its ``join``, at ERROR,
    like a crash. Now a stop code keeps the line, at INFO, without it; a crash keeps both."""
    import logging

    from torch.multiprocessing.spawn import ProcessExitedException

    from trainguard.elastic.launcher import _PreformatExceptions

    try:
        raise ProcessExitedException(f"process 0 terminated with exit code {code}", error_index=0, error_pid=1,
                                     exit_code=code)
    except ProcessExitedException:
        info = sys.exc_info()
    record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                               "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
                               (code, 0, 1, "run_script_path", "fork"), info)
    assert _PreformatExceptions().filter(record)
    text = logging.Formatter().format(record)
    assert text.startswith(f"failed (exitcode: {code})")
    assert ("Traceback" in text) is traceback_kept, text
    assert record.levelno == (logging.ERROR if traceback_kept else logging.INFO)


# Trains to step 8 with an all-reduce per step, saving every 2; on the first attempt global rank 1
# (the worker of the other node) sends itself SIGTERM at step 5: a signal to one node's workers.
TWO_NODES = """\
    import os, signal, sys
    import torch
    import torch.distributed as dist
    import trainguard as tg

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(2)) as mgr:
        step = mgr.restore({"model": model}) or 0
        while step < 8 and not mgr.should_stop:
            step += 1
            dist.all_reduce(torch.zeros(1))
            if step == 5 and rank == 1 and not os.path.exists(os.path.join(out, "signalled")):
                open(os.path.join(out, "signalled"), "w").close()
                os.kill(os.getpid(), signal.SIGTERM)
            mgr.save(step, {"model": model}, force=step == 8)
    print(f"rank {rank} ended at step {step}", flush=True)
    sys.exit(mgr.exit_code)
"""


@pytest.mark.timeout(150)
def test_two_nodes_sigterm_to_one_nodes_worker_ends_both_agents_with_143(tmp_path: Path) -> None:
    """Two agents (--nnodes 2, c10d on a store this test hosts, 1 worker each). Before: both workers
    saved and stopped at the same step, node 0's worker (rank 0: the job's c10d store) exited 143
    and its agent 143, but rank 1, still reading the last save's commit, failed (the store had gone
    with rank 0's process): exit 1, a restart into the closed rendezvous, and its agent exited 1
    (2 of 2 runs). Now both agents exit 143, nothing restarted, the stop step is the newest checkpoint."""
    import torch.distributed as dist

    import trainguard as tg

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TWO_NODES))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "two",
           "--rdzv-conf", "is_host=false,last_call_timeout=5", "--start-method", "fork", "--run-path",
           "--run-dir", str(run_dir), str(script), str(tmp_path)]
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    procs = []
    try:
        for log in logs:
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True))
    finally:
        codes = _wait_all(procs, logs, 120)
    text = "\n=====\n".join(x.read_text(errors="replace")[-3000:] for x in logs)
    assert codes == [143, 143], text
    ends = sorted(int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if " ended at step " in line)
    assert len(ends) == 2 and ends[0] == ends[1] and 5 <= ends[0] < 8, text
    assert tg.CheckpointManager(run_dir).latest_step() == ends[0]
    events = (run_dir / "events.jsonl").read_text()
    assert '"restart"' not in events and events.count('"preempted": true') == 2, text
    assert "Traceback" not in text, text


def test_a_permanent_error_followed_by_the_loss_of_rank_0s_store_stays_permanent() -> None:
    """Two nodes, the state does not fit the checkpoint on both: rank 0 raised its
    ``StateMismatchError`` and exited 78 (its process hosts the store); rank 1 then failed in the
    load's exchange of that error with "the c10d store stopped answering": not permanent, exit 1,
    its agent restarted into the closed rendezvous and exited 1 (1 of 2 runs: 78 and 1). Now a rank
    whose exchange fails raises its own error no restart fixes (``errors.agree_load``). A lost store
    in a *script's* retry inside its ``except`` block for such an error stays a transient failure."""
    import trainguard as tg
    from trainguard.errors import StateMismatchError, agree_load, failure

    class LostStore:  # the exchange's store call: rank 0's process is gone
        is_distributed, rank = True, 1

        def all_gather(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            raise failure("load: the c10d store stopped answering (DistNetworkError: Connection reset by peer); "
                          "the process hosting it (rank 0, or the launcher) died or hangs", {0: "unreachable"})

    mismatch = StateMismatchError(missing=[], unexpected=[], mismatched=["model/weight"])
    for own, code in ((mismatch, 78), (ValueError("a bug of the script"), 1), (None, 1)):
        try:
            agree_load(LostStore(), "loaded", "ckpt", own, None)
        except Exception as e:  # noqa: BLE001 - its exit code is the check
            assert tg.exit_code_for(e) == code, (own, e)
        else:
            raise AssertionError("not raised")
    try:  # the script caught the mismatch and retried: the retry's lost store is no permanent failure
        try:
            raise mismatch
        except StateMismatchError:
            agree_load(LostStore(), "loaded", "ckpt", None, None)
    except Exception as e:  # noqa: BLE001
        assert tg.exit_code_for(e) == 1, e
