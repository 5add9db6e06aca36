"""Review of `trainguard run` (elastic agent, watchdog): regressions for what it found."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import torch

import trainguard as tg
import trainguard.manager as manager_mod
from trainguard.elastic import watchdog
from trainguard.elastic.watchdog import Watchdog


def _heart(monkeypatch) -> Watchdog:
    class Heart:
        watchdog = Watchdog(timeout=1.0)  # not started: only its state is looked at

    monkeypatch.setattr(watchdog, "_HEART", Heart())
    return Heart.watchdog


def test_rollback_restore_and_wait_in_the_loop_are_not_timed_as_a_hang(tmp_path, monkeypatch):
    # A rollback (mgr.restore inside the loop, after the first heartbeat) that read a large checkpoint
    # for longer than the hang timeout was declared a hang: `trainguard run --hang-timeout 2` with a
    # restore taking 4 s ended both ranks with exit 75. restore() and wait() are now paused, as save() is.
    state = {"model": torch.nn.Linear(2, 2)}
    seen: list[tuple[str, bool]] = []
    wd = Watchdog(timeout=1.0)  # replaced by the process's watchdog below
    real_load, real_finish = manager_mod.load, manager_mod.CheckpointManager._finish_pending

    def load(*a, **k):
        seen.append(("load", wd._paused))
        return real_load(*a, **k)

    def finish(self):
        seen.append(("wait", wd._paused))
        return real_finish(self)

    monkeypatch.setattr(manager_mod, "load", load)
    monkeypatch.setattr(manager_mod.CheckpointManager, "_finish_pending", finish)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1)) as mgr:
        mgr.save(1, state)  # no _HEART yet: the watchdog arms at a heartbeat inside trainguard run
        wd = _heart(monkeypatch)
        wd.beat(2)
        seen.clear()
        mgr.wait()
        assert seen == [("wait", True)] and not wd._paused  # timed again after it: a real hang is still one
        seen.clear()
        assert mgr.restore(state) == 1
        assert ("load", True) in seen and all(p for _, p in seen), seen
        assert not wd._paused
    assert wd._paused  # close() suspends until the next heartbeat; its own wait() does not resume it


class _Proc:
    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode


def test_the_rank_that_raised_first_is_the_failure_not_the_first_in_process_order(tmp_path, monkeypatch):
    # `trainguard run --run-path --start-method fork --fault step=5,rank=1,kind=exception`: rank 1 raised,
    # rank 0 then failed in its all_reduce (gloo: connection closed by peer), both exit 1, and torch's
    # join reports the first in process order: the failure event named rank 0 (2 of 2 runs). Each
    # --run-path worker now notes when its script raised; the agent names the first.
    from torch.multiprocessing.spawn import ProcessExitedException

    from trainguard.elastic import stops

    monkeypatch.setenv(stops.STOP_FILE_ENV, str(tmp_path / "stopped-agent"))
    monkeypatch.setattr(stops.os, "getpid", lambda: 2001)
    stops.note_raised()  # rank 1 (pid 2001): its own exception, first
    monkeypatch.setattr(stops.os, "getpid", lambda: 2000)
    stops.note_raised()  # rank 0 (pid 2000): its collective's error, after rank 1's process ended

    class PC:
        processes = [_Proc(2000, 1), _Proc(2001, 1)]

    reported = ProcessExitedException("process 0 terminated with exit code 1", error_index=0, error_pid=2000,
                                      exit_code=1)
    cause = stops.root_failure(PC(), reported)
    assert cause is not reported and cause.error_index == 1 and cause.error_pid == 2001
    assert list(tmp_path.iterdir()) == []  # the notes are read once and removed
    assert stops.root_failure(PC(), reported) is reported  # no notes (script workers): as torch says


def test_run_path_worker_notes_its_exception(tmp_path, monkeypatch):
    from trainguard import permanent
    from trainguard.elastic import reap, stops

    monkeypatch.setattr(reap, "own_session", lambda: None)  # not setsid() in the test process
    monkeypatch.setenv(stops.STOP_FILE_ENV, str(tmp_path / "stopped-agent"))
    script = tmp_path / "train.py"
    script.write_text("raise RuntimeError('a bug of the script')\n")
    with pytest.raises(RuntimeError, match="a bug"):
        permanent.run_script_path(str(script))
    assert stops.raised_at(os.getpid()) is not None


class _Failure:
    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode


def test_script_workers_failure_names_the_rank_that_raised_first(tmp_path, monkeypatch):
    # Script workers, `--monitor-interval 2 --fault step=5,rank=1,kind=exception`: by the agent's poll
    # both ranks had exited 1 (rank 0's all_reduce failed on rank 1's closed connection) and the
    # failure event named rank 0. The workers' excepthook now notes when each raised.
    from trainguard import permanent
    from trainguard.elastic import stops

    stop = tmp_path / "stopped-agent"
    monkeypatch.setenv(stops.STOP_FILE_ENV, str(stop))
    monkeypatch.setattr(permanent._hook, "previous", lambda *a: None, raising=False)
    for pid in (3001, 3000):  # rank 1's exception first, then rank 0's
        monkeypatch.setattr(stops.os, "getpid", lambda pid=pid: pid)
        try:
            raise RuntimeError("boom")
        except RuntimeError as e:
            permanent._hook(RuntimeError, e, e.__traceback__)
    assert stops.first_failure({0: _Failure(3000, 1), 1: _Failure(3001, 1)}) == 1
    assert stops.first_failure({0: _Failure(3000, 1), 1: _Failure(3001, 1)}) == 0  # no notes: as before
    stop.with_suffix(".raised-9").write_text("1")  # a note no failure read (a rank the agent SIGTERMed later)
    stops.clear(str(stop))
    assert list(tmp_path.iterdir()) == []  # removed before the workers (re)start


def test_an_orphaned_worker_ends_its_dataloader_processes(monkeypatch):
    # `trainguard run --fault step=10,rank=1,kind=agent` with DataLoader(num_workers=2): rank 0 exited
    # orphaned (76, os._exit) and its 2 loader processes lived on after it and the agent (until torch's
    # loader watchdog, ~5 s). The watchdog now SIGKILLs the worker's multiprocessing children first.
    # In a process of its own: end_children() SIGKILLs every multiprocessing child of its process, and in
    # the pytest worker that included DataLoader workers another test had left alive, whose SIGCHLD
    # handler then failed this test ("DataLoader worker (pid ...) is killed by signal: Killed").
    from conftest import run_py

    res = run_py(["-c", (
        "import multiprocessing, time\n"
        "from trainguard.elastic import reap\n"
        "child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(120,), daemon=True)\n"
        "child.start()\n"
        "reap.end_children()\n"
        "child.join(20)\n"
        "print('exit', child.exitcode)\n"
    )], timeout=60)
    assert res.returncode == 0 and res.stdout.split() == ["exit", "-9"], res

    exits: list[int] = []
    ended: list[bool] = []
    wd = Watchdog(agent_pid=2**22 + 12345, check_every=0.01)  # no such process: the agent is gone
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (exits.append(code), wd.stop()))
    monkeypatch.setattr(watchdog, "end_children", lambda: ended.append(not exits))
    wd._run()
    assert exits == [watchdog.ORPHAN_EXIT] and ended == [True]  # the children first, then the exit


def test_script_worker_close_ends_the_group_of_a_worker_that_had_exited(monkeypatch):
    # Script workers, `--hang-timeout 2 --fault step=10,rank=1,kind=hang` with DataLoader(num_workers=2):
    # both ranks exited 75 (os._exit) and the agent exited 1 with their 4 loader processes still
    # running: torch's close signals only workers still running. Now what is left of each group goes.
    import subprocess
    import sys
    import time

    from trainguard.elastic import reap, spare

    monkeypatch.setattr(spare, "install", lambda cls: None)  # torch's handler class stays as it is here
    leader = subprocess.Popen(  # a worker that exited, its child (a loader process) left in its group
        [sys.executable, "-c", "import os, time\nif os.fork() == 0:\n    time.sleep(120)\nelse:\n"
         "    print(os.getpid() + 0, flush=True)\n    os._exit(75)\n"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leader.wait(30) == 75
    leader.stdout.close()
    def group(pid: int) -> int | None:  # None for a process that ended meanwhile (other tests' processes)
        try:
            return os.getpgid(pid)
        except ProcessLookupError:
            return None

    child = next(int(p) for p in os.listdir("/proc") if p.isdigit() and reap.running(int(p))
                 and group(int(p)) == leader.pid)

    class Handler:
        proc = leader

    class Context:
        subprocess_handlers = {0: Handler()}

        def _poll(self):
            return None

        def _close(self, death_sig, timeout=30):  # torch's: the exited worker is not signalled
            pass

    reap.bound_failure_close(Context, 1.0)
    try:
        Context()._close(signal.SIGTERM, 1)
        deadline = time.monotonic() + 10
        while reap.running(child) and time.monotonic() < deadline:
            os.sched_yield()
        assert not reap.running(child)
    finally:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
