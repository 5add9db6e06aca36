"""Session-54 hunt of tests that fail now and then under load (flaky54).

What a test leaves in its pytest process reaches every test that runs after it there: with
``-n 3 --dist loadscope`` an xdist worker runs whole modules one after the other, largest first.
``test_fault_agent42`` failed in CI with two more kills of its process than its drill's: the
``trainguard-watchdog`` threads of two ``_Heart()`` objects (test_elastic.py) probed the process
(``os.kill(pid, 0)``, every 0.2 s), started because an earlier module (test_hunt52_run52) had run
``launcher.prepare`` in the worker, which wrote ``TRAINGUARD_WATCHDOG=1`` and
``TRAINGUARD_AGENT_PID=<the worker>`` into its environment for good. conftest's autouse
``_nothing_leaks_into_later_tests`` now puts the environment back after each test and fails a test
that leaves a watchdog running. Checked here in a pytest process of its own, with the suite's conftest."""

from __future__ import annotations

import contextlib
import re
import shutil
import textwrap
from pathlib import Path

from conftest import TESTS, run_py

LATER = '''
import os, threading

def test_later():
    assert "TRAINGUARD_AGENT_PID" not in os.environ and "TRAINGUARD_WATCHDOG" not in os.environ
    assert [t.name for t in threading.enumerate() if t.name == "trainguard-watchdog"] == []
'''


def _pytest(tmp_path: Path, first: str) -> str:
    """Run ``first`` (a test module's source), then ``LATER``, in one pytest process with the suite's
    conftest; its report."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_1_first.py").write_text(textwrap.dedent(first))
    (tmp_path / "test_2_later.py").write_text(LATER)
    res = run_py(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA",
                  str(tmp_path / "test_1_first.py"), str(tmp_path / "test_2_later.py")], timeout=120)
    return res.stdout + res.stderr


def test_the_agent_environment_prepare_writes_does_not_reach_later_tests(tmp_path):
    out = _pytest(tmp_path, '''
        import os
        from trainguard.elastic.launcher import build_parser, prepare

        def test_prepare(tmp_path):
            args = build_parser().parse_args(["--run-dir", str(tmp_path / "run"), "train.py"])
            prepare(args)  # outside monkeypatch, as test_hunt52_run52 did
            os.rmdir(args.log_dir)  # the agent's exit removes it (atexit); this process is pytest's
            assert os.environ["TRAINGUARD_AGENT_PID"] == str(os.getpid())
        ''')
    assert re.search(r"PASSED \S*test_1_first.py::test_prepare", out), out
    assert re.search(r"PASSED \S*test_2_later.py::test_later", out), out


def test_a_hang_watchdog_left_running_fails_its_test_and_is_stopped(tmp_path):
    out = _pytest(tmp_path, '''
        import os
        from trainguard.elastic.watchdog import _Heart

        def test_heart(monkeypatch):
            monkeypatch.setenv("TRAINGUARD_WATCHDOG", "1")
            monkeypatch.setenv("TRAINGUARD_AGENT_PID", str(os.getpid()))
            _Heart()  # its watchdog thread probes this process every 0.2 s, never stopped
        ''')
    assert re.search(r"ERROR \S*test_1_first.py::test_heart", out) and "watchdog thread(s) left running" in out, out
    assert re.search(r"PASSED \S*test_2_later.py::test_later", out), out


# A worker of a forkserver job (its parent: the forkserver, which set torch's parent-death SIGINT): every
# process got SIGTERM, the forkserver died of it, and the worker's main thread (in a gloo collective: here,
# both signals blocked) handled SIGTERM and the parent-death SIGINT together. Python runs pending handlers
# lowest number first: SIGINT's, then SIGTERM's; the manager kept the first, and exited 130, not 143.
DEAD_PARENT = '''
import ctypes, os, signal, sys, time
import torch
import trainguard as tg

ready_r, ready_w = os.pipe()
if os.fork():  # the forkserver: it dies once the worker is in its step, SIGTERMed
    os.close(ready_w)
    os.read(ready_r, 1)
    os._exit(0)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # every thread: they come together
ctypes.CDLL(None).prctl(1, int(signal.SIGINT))  # PR_SET_PDEATHSIG, as torch's worker wrapper sets it
parent = os.getppid()
with tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1000)) as mgr:
    os.kill(os.getpid(), signal.SIGTERM)  # the preemption, first
    os.write(ready_w, b"x")
    deadline = time.monotonic() + 60
    while signal.SIGINT not in signal.sigpending() and time.monotonic() < deadline:  # the parent's death
        time.sleep(0.01)
    print("pending", sorted(int(s) for s in signal.sigpending()), "parent gone", os.getppid() != parent, flush=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # the collective returned
    mgr.save(1, {"w": torch.ones(2)})
    stopped = mgr.should_stop
print("stopped", stopped, "exit", mgr.exit_code, flush=True)
'''


def test_a_sigterm_handled_with_a_dead_forkservers_sigint_is_exit_143(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "worker.py"
    script.write_text(DEAD_PARENT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)  # EOF: the worker (which holds stdout too) ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the worker, left in the session if the test failed
    assert f"pending [{int(signal.SIGINT)}, {int(signal.SIGTERM)}] parent gone True" in out, out
    assert "stopped True exit 143" in out, out  # 130 before: SIGINT's handler ran first
