"""Review of what a stopped job tells its scheduler (docs/elastic.md, "Exit codes for a requeue
wrapper"): a run stopped by a stop signal exits with 128 + the signal, whoever was signalled,
so that a requeue wrapper resumes it instead of taking it for finished. Real agent, 2 gloo ranks;
the signal comes from the worker itself at a known step (no timing)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_elastic_edges import CLI

ROOT = Path(__file__).resolve().parent.parent

# Trains to step 6, an all-reduce per step (as DDP's backward: the ranks stay within a step); on
# the first attempt (no <out>/signalled yet) rank 1 sends itself SIGTERM in step 3: a signal to
# the workers only (scancel --signal=TERM on the step's tasks); all stop at step 3 or 4. argv[2]:
# "return" ends the script normally, "exit" ends it with sys.exit(mgr.exit_code).
WORKER = """\
    import os, signal, sys
    import torch
    import torch.distributed as dist
    import trainguard as tg

    out, how = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(10**6)) as mgr:
        step = mgr.restore({"model": model}) or 0
        while step < 6 and not mgr.should_stop:
            step += 1
            dist.all_reduce(torch.zeros(1))
            if step == 3 and rank == 1 and how != "crash" and not os.path.exists(os.path.join(out, "signalled")):
                open(os.path.join(out, "signalled"), "w").close()
                os.kill(os.getpid(), signal.SIGTERM)
            mgr.save(step, {"model": model}, force=step == 6)
    print(f"rank {rank} ended at step {step} ", flush=True)
    if how == "exit":
        sys.exit(mgr.exit_code)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _run(cmd: list[str], log: Path, timeout: float = 120) -> int:
    """Run ``cmd`` in its own session, bounded; whatever is left of it is SIGKILLed by group."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd[:6]} did not end in {timeout} s\n{log.read_text(errors='replace')[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def _stopped_at(text: str) -> int:
    """The step both ranks of the first attempt ended at (one step for both)."""
    ends = [int(line.split("ended at step ")[1].split()[0]) for line in text.splitlines() if "ended at step " in line]
    assert len(ends) >= 2 and ends[0] == ends[1], text[-3000:]
    return ends[0]


def _agent(tmp_path: Path, how: str, *flags: str) -> list[str]:
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(WORKER))
    return [*CLI, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), *flags, str(train), str(tmp_path), how]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", [pytest.param("return", marks=pytest.mark.slow), "exit"])  # return: make test-slow
def test_sigterm_to_the_workers_alone_is_a_preemption_for_trainguard_run(tmp_path: Path, how: str) -> None:
    """Before: a SIGTERM that reached the workers but not the agent made them save at step 3 (or 4) and
    return, and ``trainguard run`` exited 0, a finished job for any requeue wrapper: the run never
    went past it. A script exiting with 143 (now ``mgr.exit_code``) was restarted by the agent
    as a failure (max-restarts 3), ran on to step 6 against its node's preemption and exited 0.
    Now the agent ends with 143 either way, without a restart."""
    log = tmp_path / "agent.log"
    rc = _run(_agent(tmp_path, how), log)
    text = log.read_text(errors="replace")
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    assert _stopped_at(text) in (3, 4)
    assert tg.CheckpointManager(tmp_path / "run").latest_step() == _stopped_at(text)  # the preemption save
    assert not _events(tmp_path / "run", "restart"), text[-3000:]
    exits = _events(tmp_path / "run", "agent_exit")
    assert exits and exits[-1].get("preempted") is True and exits[-1].get("signal") == "SIGTERM", exits


@pytest.mark.timeout(150)
def test_a_crash_and_the_agents_own_sigterm_are_no_preemption(tmp_path: Path) -> None:
    """Guard: rank 1 dies at step 3 (a drill's ``os._exit(43)``); the agent SIGTERMs rank 0, whose
    manager notes the signal as it ends; the agent restarts both (a failure, not a preemption:
    the note is cleared at the restart) and the job finishes: exit 0, one restart."""
    log = tmp_path / "agent.log"
    rc = _run(_agent(tmp_path, "crash", "--fault", "step=3,rank=1,kind=exit"), log)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert text.count("ended at step 6 ") == 2, text[-3000:]
    assert len(_events(tmp_path / "run", "restart")) == 1, text[-3000:]
    assert _events(tmp_path / "run", "agent_exit")[-1]["ok"] is True


@pytest.mark.timeout(200)
def test_the_documented_requeue_wrapper_resumes_a_preempted_run(tmp_path: Path) -> None:
    """examples/requeue.sh (shown in docs/elastic.md) around ``trainguard run``: the first
    attempt is preempted at step 3 or 4 (its workers alone signalled), the wrapper starts it
    again, it resumes there and finishes step 6. Before: the first attempt exited 0, the wrapper
    said "finished" and the run stopped at step 3 or 4 of 6."""
    log = tmp_path / "wrapper.log"
    rc = _run(["bash", str(ROOT / "examples" / "requeue.sh"), *_agent(tmp_path, "return")], log, timeout=180)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "requeue: stopped by a signal after its save (exit 143): resume" in text, text[-3000:]
    stopped = _stopped_at(text)
    assert stopped in (3, 4) and text.count("ended at step 6 ") == 2, text[-3000:]
    assert text.rstrip().endswith("requeue: finished"), text[-3000:]
    assert tg.CheckpointManager(tmp_path / "run").latest_step() == 6
    assert [e["step"] for e in _events(tmp_path / "run", "restore")] == [stopped] * 2  # each rank resumed there


def _plain(tmp_path: Path, signum: int | None, during_close: bool = False) -> tg.CheckpointManager:
    model = torch.nn.Linear(2, 2)
    mgr = tg.CheckpointManager(tmp_path / "ck", save=tg.EveryNSteps(10**6))
    with mgr:
        for step in range(1, 5):
            if step == 2 and signum is not None and not during_close:
                os.kill(os.getpid(), signum)
            mgr.save(step, {"model": model})
            if mgr.should_stop:
                break
        if during_close and signum is not None:
            os.kill(os.getpid(), signum)  # after the last save(): only close() sees it
    return mgr


@pytest.mark.parametrize(("signum", "during_close", "code"), [
    (None, False, 0), (signal.SIGTERM, False, 143), (signal.SIGINT, False, 130), (signal.SIGTERM, True, 143),
])
def test_exit_code_of_a_plain_process(tmp_path: Path, signum: int | None, during_close: bool, code: int) -> None:
    """``mgr.exit_code`` after ``close()``: what ``python train.py`` / a torchrun worker exits with.
    Before there was none: a preempted plain run exited 0, and a signal after the last ``save()``
    (while ``close()`` waited for the last save) was a flag nobody read."""
    mgr = _plain(tmp_path, signum, during_close)
    assert mgr.exit_code == code
    assert mgr.stopped_by == (None if signum is None else int(signum))
    if signum is not None and not during_close:
        assert mgr.should_stop and mgr.latest_step() == 2  # the preemption save, as before


def test_a_python_script_that_exits_with_exit_code(tmp_path: Path) -> None:
    """The same through a real interpreter exit: ``sys.exit(mgr.exit_code)`` gives the shell 143."""
    script = tmp_path / "t.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys
        import torch
        import trainguard as tg
        model = torch.nn.Linear(2, 2)
        with tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(10**6)) as mgr:
            for step in range(1, 5):
                if step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                mgr.save(step, {"model": model})
                if mgr.should_stop:
                    break
        sys.exit(mgr.exit_code)
    """))
    rc = _run([sys.executable, str(script), str(tmp_path / "ck")], tmp_path / "log", timeout=60)
    assert rc == 143, (tmp_path / "log").read_text()
