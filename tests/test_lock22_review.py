"""Session 22 review (area "lock"): the run directory's lock at an async save's commit, and what
``trainguard run`` does when the lock is lost.

An async save checked the run lock only when it started (``CheckpointManager._save_now``'s
preflight); its commit runs later in the background. A ``.lock`` removed meanwhile: step 2 was
committed into a directory no longer locked by the job. An ``rm -rf`` of the run directory before
the background thread wrote: the save's ``makedirs`` recreated the directory, unlocked, and
committed step 2 there. The background save is held at a known point by an event (no timing)."""

from __future__ import annotations

import os
import shutil
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_elastic_edges import CLI
from test_exitcodes15_review import _run
from trainguard import api
from trainguard.permanent import PERMANENT_EXIT, is_permanent


def _state(v: float) -> dict:
    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.fill_(v)
    return {"m": m}


class _Held:
    """Replaces ``api.<name>`` (called by the save's background thread on rank 0): the save stops
    there until ``go()``; ``reached()`` waits until it got there (both bounded)."""

    def __init__(self, name: str) -> None:
        self.name, self.orig = name, getattr(api, name)
        self._at, self._go = threading.Event(), threading.Event()
        setattr(api, name, self)

    def __call__(self, *a, **k):
        self._at.set()
        assert self._go.wait(30), "never released"
        return self.orig(*a, **k)

    def reached(self) -> None:
        assert self._at.wait(30), f"the save never reached {self.name}"

    def go(self) -> None:
        setattr(api, self.name, self.orig)
        self._go.set()


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) if run.exists() else []


@pytest.mark.parametrize("held", ["occupied", "_write_rank", "check_shared"], ids=["before-mkdir", "before-writing", "before-commit"])
@pytest.mark.parametrize("how", ["rm -rf run", "rm run/.lock", "another .lock"])
def test_async_save_whose_lock_is_lost_after_it_started_does_not_commit(tmp_path, how, held):
    """Before: "rm run/.lock" and "another .lock" committed step 2 (wait() raised nothing); "rm -rf
    run" before the save's makedirs committed step 2 alone into a recreated, unlocked directory;
    later it failed by chance (its temp directory gone: a FileNotFoundError of a data file or the
    manifest, not permanent). Now the commit checks the lock, and a failed save names the lost
    lock as its cause: a permanent CheckpointError at wait(), step 2 nowhere."""
    run = tmp_path / "run"
    mgr = tg.CheckpointManager(str(run), async_save=True, save=tg.EveryNSteps(1), handle_signals=False).open()
    try:
        mgr.save(1, _state(1.0))
        mgr.wait()
        hold = _Held(held)
        try:
            mgr.save(2, _state(2.0))
            hold.reached()
            if how == "rm -rf run":
                shutil.rmtree(run)
            else:
                os.remove(run / ".lock")
            if how == "another .lock":  # as a second job opening the directory writes it
                (run / ".lock").write_text('{"pid": 1, "host": "elsewhere", "since": 0}')
        finally:
            hold.go()
        with pytest.raises(tg.CheckpointError, match=r"\.lock was (removed|replaced by another file) while this job held it") as e:
            mgr.wait()
        assert is_permanent(e.value) and tg.exit_code_for(e.value) == PERMANENT_EXIT
    finally:
        mgr.close()
    assert _steps(run) == ([] if how == "rm -rf run" else ["step-000000001"])
    assert not [p for p in (run.iterdir() if run.exists() else []) if ".tmp-" in p.name]  # no half-written save left


@pytest.mark.parametrize("how", ["rm -rf run", "rm run/.lock"])
def test_ram_tier_copy_whose_lock_is_lost_does_not_commit(tmp_path, monkeypatch, how):
    """The RAM tier's background copy of step 2 to the run directory, held at its first file:
    before, with "rm run/.lock" it committed step 2 there (close() raised nothing); with "rm -rf
    run" close() raised the copy's FileNotFoundError (exit 1). Now close() raises the lost lock,
    permanent, and the run directory holds no step 2."""
    from trainguard import tiers

    (tmp_path / "ram").mkdir()
    run = tmp_path / "run"
    mgr = tg.CheckpointManager(str(run), ram_tier=str(tmp_path / "ram"), save=tg.EveryNSteps(1), handle_signals=False).open()
    try:
        mgr.save(1, _state(1.0))
        mgr.ram.wait()  # type: ignore[union-attr]
        orig, at, go = tiers._copy, threading.Event(), threading.Event()

        def held(*a, **k):
            at.set()
            assert go.wait(30), "never released"
            return orig(*a, **k)

        monkeypatch.setattr(tiers, "_copy", held)
        try:
            mgr.save(2, _state(2.0))
            assert at.wait(30), "the copy to the run directory never started"
            monkeypatch.setattr(tiers, "_copy", orig)
            shutil.rmtree(run) if how == "rm -rf run" else os.remove(run / ".lock")
        finally:
            go.set()
    finally:
        with pytest.raises(tg.CheckpointError, match=r"\.lock was removed") as e:
            mgr.close()
    assert is_permanent(e.value), str(e.value)
    assert _steps(run) == ([] if how == "rm -rf run" else ["step-000000001"])


def _ranks_async(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    mgr = tg.CheckpointManager(root, async_save=True, save=tg.EveryNSteps(1), handle_signals=False, timeout=30).open()
    try:
        mgr.save(1, _state(1.0))
        mgr.wait()
        hold = _Held("check_shared") if rank == 0 else None
        try:
            mgr.save(2, _state(2.0))
            if hold is not None:  # rank 0's background save waits at its commit; the run directory goes
                hold.reached()
                shutil.rmtree(root)
        finally:
            if hold is not None:
                hold.go()
        try:
            mgr.wait()
            out["saved"] = True
        except tg.CheckpointError as e:
            out["error"], out["permanent"] = str(e), is_permanent(e)
    finally:
        mgr.close()
    out["step2"] = os.path.exists(os.path.join(root, "step-000000002"))
    return out


def test_async_commit_with_the_lock_lost_fails_on_every_rank(tmp_path):
    """Two gloo ranks: rank 0 finds the lock gone at the commit; the save's own "commit" round
    carries the error, marked permanent, to rank 1 (before: both ranks raised a FileNotFoundError
    of rank 0's manifest, not permanent), and nothing is committed."""
    from dist_helper import run_ranks

    res = run_ranks(_ranks_async, 2, str(tmp_path / "run"), timeout=60)
    assert all(r.error is None and r.exitcode == 0 for r in res), [r.error for r in res]
    for r in res:
        assert "saved" not in r.value, (r.rank, r.value)
        assert ".lock was removed" in r.value["error"], (r.rank, r.value["error"][-2000:])
        assert r.value["permanent"] is True and r.value["step2"] is False, (r.rank, r.value)


# Saves step 1; rank 0 removes the run directory (`rm -rf` by an operator); the save of step 2
# fails. Prints "start" at each start: a restart is seen in the log.
WORKER = """\
    import os, shutil
    import torch
    import torch.distributed as dist
    import trainguard as tg

    dist.init_process_group("gloo")
    root = os.environ["TRAINGUARD_RUN_DIR"]
    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        start = mgr.restore({"model": model}) or 0
        print(f"rank {dist.get_rank()} start at step {start}", flush=True)
        for step in range(start + 1, 4):
            dist.all_reduce(torch.zeros(1))
            if step == 2 and dist.get_rank() == 0:
                shutil.rmtree(root)
            mgr.save(step, {"model": model})
    print(f"rank {dist.get_rank()} ended", flush=True)
"""


@pytest.mark.timeout(150)
def test_trainguard_run_does_not_restart_a_job_whose_run_directory_was_removed(tmp_path: Path) -> None:
    """Before: the lock-lost error was not permanent; the agent restarted the workers, which
    opened the recreated empty directory and trained again from step 0 (exit 0). Now every rank
    exits 78, the agent restarts nothing and says why."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(WORKER))
    log = tmp_path / "agent.log"
    rc = _run([*CLI, "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), str(train)], log)
    text = log.read_text(errors="replace")
    assert rc == PERMANENT_EXIT, text[-3000:]
    assert text.count("start at step") == 1 and "ended" not in text, text[-3000:]
    line = [x for x in text.splitlines() if x.startswith("trainguard run: rank(s)")]
    assert len(line) == 1 and "a restart will not fix" in line[0] and ".lock was removed" in line[0], text[-3000:]
    assert "begins at step 0" in line[0] and "then start the job again" in line[0], line[0]  # what to do, not cut off
    assert _steps(tmp_path / "run") == []


def _another_job(lock: Path) -> tuple[str, int, int]:
    """A forked process that tries to take ``lock`` as a second job's manager does (a POSIX lock on
    a new descriptor, its holder info written); it holds what it got until the returned pipe's
    write end is closed (bounded: 30 s). Returns ("took" or "busy", its pid, that write end)."""
    import fcntl
    import json
    import select

    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # only os calls here, then os._exit
        try:
            os.close(r1)
            os.close(w2)
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": "other", "since": 0}).encode(), 0)
                os.write(w1, b"took")
            except OSError:
                os.write(w1, b"busy")
            select.select([r2], [], [], 30)
        finally:
            os._exit(0)
    os.close(w1)
    os.close(r2)
    assert select.select([r1], [], [], 30)[0], "the other job never answered"
    said = os.read(r1, 16).decode()
    os.close(r1)
    return said, pid, w2


def _end(pid: int, w: int) -> None:
    os.close(w)
    os.waitpid(pid, 0)


def test_lock_released_by_the_training_process_itself_is_caught_at_the_next_save(tmp_path):
    """A POSIX lock goes when *any* descriptor of the file closes in the holding process: a
    ``shutil.copytree`` of the run directory from the training script (a backup) released it, a
    second job then took it and opened the directory as a writer, and the first job's next save
    committed (the .lock was still the same file, so nothing noticed). Now that save fails,
    permanent, naming the other holder; step 2 is not committed."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0), force=True)
        shutil.copytree(run, tmp_path / "backup")  # opens and closes run/.lock in this process
        said, pid, w = _another_job(run / ".lock")
        try:
            assert said == "took"  # what the copy did: no lock any more
            with pytest.raises(tg.CheckpointError, match=r"\.lock was locked by another job \(pid \d+ on other") as e:
                mgr.save(2, _state(2.0), force=True)
            assert is_permanent(e.value)
        finally:
            _end(pid, w)
    assert _steps(run) == ["step-000000001"]


def test_lock_released_by_the_training_process_is_taken_again_when_nobody_took_it(tmp_path):
    """Guard of the check above: released by an in-process copy with no other job around, the
    next save takes the lock again (before: the directory stayed unlocked for the rest of the
    run) and saves; another job then finds it locked."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0), force=True)
        shutil.copytree(run, tmp_path / "backup")
        mgr.save(2, _state(2.0), force=True)
        said, pid, w = _another_job(run / ".lock")
        _end(pid, w)
        assert said == "busy"
    assert _steps(run) == ["step-000000001", "step-000000002"]


def test_close_in_a_forked_child_keeps_the_parents_lock_info(tmp_path):
    """A child forked while the manager is open (os.fork in the script) that leaves its ``with``
    block calls close(): it truncated the shared .lock, so a second job's LockedError named no
    holder ("in use by another job ()") and was not permanent (restarted by trainguard run). Now
    the child, which holds no lock, leaves the file alone."""
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run), handle_signals=False) as mgr:
        info = os.pread(mgr._lock.fd, 4096, 0)  # not open(): closing that descriptor would release the lock
        pid = os.fork()
        if pid == 0:
            try:
                mgr.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.pread(mgr._lock.fd, 4096, 0) == info and f'"pid": {os.getpid()}'.encode() in info
        said, pid, w = _another_job(run / ".lock")
        _end(pid, w)
        assert said == "busy"
