"""Review of preemption under ``trainguard run``: stop signals to the agent while its workers
commit their preemption save (real agent, real worker processes, gloo)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import psutil
import pytest

import trainguard as tg
from test_elastic_edges import CLI, _gone, _kill_all, _wait_for

# A worker whose preemption save blocks in its first file's finish until the test creates
# <dir>/release (bounded: 60 s); <dir>/saving says the save is in progress.
SLOW_SAVE_WORKER = """\
    import os, sys, time
    import torch
    import trainguard as tg
    from trainguard.storage import local

    out = sys.argv[1]
    finish = local._LocalWriter.finish

    def held_finish(self, size):
        open(os.path.join(out, "saving"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return finish(self, size)

    local._LocalWriter.finish = held_finish
    model = torch.nn.Linear(4, 4)
    deadline = time.monotonic() + 60  # bounded even when no signal comes
    with tg.CheckpointManager(os.environ["TRAINGUARD_RUN_DIR"], save=tg.EveryNSteps(10**6)) as mgr:
        step = 0
        while not mgr.should_stop and time.monotonic() < deadline:
            step += 1
            time.sleep(0.02)
            mgr.save(step, {"model": model})
            if step == 1:
                open(os.path.join(out, "armed"), "w").close()
    print(f"worker stopped at step {step}", flush=True)
"""


@pytest.mark.timeout(150)
def test_repeated_sigterm_to_the_agent_waits_for_the_preemption_save(tmp_path: Path) -> None:
    """Before: torch's agent handler raised at every signal. The second SIGTERM (Ctrl-C twice, a
    repeated scancel) cut the agent's wait for its workers and torch began another; the third
    ended the agent (exit 143 at once) while the worker was still writing its preemption save,
    and the orphaned worker's orphan check then ended it: no checkpoint, the requeued run started
    over. Now later signals are reported and the agent waits for the save (bounded by torch's
    shutdown timeout)."""
    run_dir, log = tmp_path / "run", tmp_path / "agent.log"
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(SLOW_SAVE_WORKER))
    cmd = [*CLI, "--nproc-per-node", "1", "--run-dir", str(run_dir), str(train), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(tg.__file__).resolve().parent.parent)}
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tree: list[int] = []

    def text() -> str:
        return log.read_text(errors="replace")

    try:
        _wait_for(lambda: (tmp_path / "armed").exists(), 100, "the first step", agent, log)
        tree = [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]
        agent.send_signal(signal.SIGTERM)
        _wait_for(lambda: (tmp_path / "saving").exists(), 30, "the preemption save", agent, log)
        for n in (1, 2):  # SIGTERM again, twice, while the worker saves
            agent.send_signal(signal.SIGTERM)
            # Before the fix: torch re-sent "closing signal" to the worker, then the agent exited.
            _wait_for(lambda n=n: text().count("SIGTERM again") >= n or text().count("closing signal") > 1,
                      30, f"the agent to take SIGTERM number {n + 1}", agent, log)
            assert agent.poll() is None and text().count("closing signal") == 1, text()[-3000:]
        (tmp_path / "release").touch()
        rc = agent.wait(timeout=60)
        out_text = text()
        assert rc == 128 + signal.SIGTERM, out_text[-3000:]
        assert "worker stopped at step" in out_text, out_text[-3000:]
        stopped = int(out_text.split("worker stopped at step")[1].split()[0])
        assert tg.CheckpointManager(run_dir).latest_step() == stopped  # what the requeued run resumes from
        _wait_for(lambda: all(_gone(p) for p in tree), 10, "the worker to exit", log=log)
    finally:
        (tmp_path / "release").touch()
        _kill_all([*tree, agent.pid])
        agent.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
