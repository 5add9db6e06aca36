"""A write that never returns (session 24, ``iostall.py``): a stalled file system held an async
save's thread in one ``pwrite`` for good, and the rank's next ``wait()``/``save()``/``close()``
waited for it with no bound (the hang watchdog paused by the save); a process that gave up still
hung at exit, joining the stuck writer. The stuck write is a real ``pwrite`` held by an event."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import StuckWriteError
from trainguard.storage import local


def _state(v: float) -> dict:
    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.fill_(v)
    return {"m": m}


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-") and ".tmp-" not in p.name)


def test_stuck_write_is_raised_and_the_save_commits_once_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, gate = threading.Event(), threading.Event()
    orig = local._LocalWriter.pwrite

    def stuck(self, data, offset):
        entered.set()
        assert gate.wait(120), "never released"
        return orig(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", stuck)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, on_error="warn", timeout=0.5) as mgr:
        try:
            mgr.save(1, _state(1.0))
            assert entered.wait(60)
            with pytest.raises(StuckWriteError, match=r"rank 0: the save of step 1 has been stuck for \d+ s in a write of "
                               r"\d+ bytes at offset \d+ of .*step-000000001.*timeout, 0.5 s"):
                mgr.wait()  # on_error="warn": raised all the same
            with pytest.raises(StuckWriteError, match="save of step 1"):
                mgr.save(2, _state(2.0))  # no second save starts while the first holds the staging memory
            assert _steps(tmp_path) == []
        finally:
            monkeypatch.setattr(local._LocalWriter, "pwrite", orig)
            gate.set()
        mgr.timeout = 120.0  # from here on no write is held: a slow fsync of a loaded machine is no stuck one
        mgr.wait()  # the same save, in flight all along, commits once its write returns
        assert mgr.last_saved_step == 1
        mgr.save(3, _state(3.0))
    assert _steps(tmp_path) == ["step-000000001", "step-000000003"]
    got = _state(0.0)
    tg.load(tmp_path / "step-000000001", got)
    assert torch.equal(got["m"].weight, torch.full((4, 4), 1.0))


SCRIPT = textwrap.dedent("""
    import sys, threading, torch, trainguard as tg
    from trainguard.storage import local
    orig, where = local._LocalWriter.pwrite, []

    def stuck(self, data, offset):  # a write of a stream's thread (not the save thread itself) never returns
        if threading.current_thread().name.startswith("trainguard-io"):
            where.append(1)
            threading.Event().wait()
        return orig(self, data, offset)

    local._LocalWriter.pwrite = stuck
    state = {"a": torch.ones(1 << 20), "b": torch.ones(1 << 20), "c": torch.ones(1 << 20)}  # 4 MiB each: one write task each
    mgr = tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1), async_save=True, timeout=1.0)
    mgr.open()
    mgr.save(1, state)
    try:
        mgr.wait()
    except tg.CheckpointError as e:
        print("STUCK" if where else "NOT-IN-A-STREAM", type(e).__name__, flush=True)
        raise
""")


def test_process_exits_after_a_stuck_write(tmp_path: Path) -> None:
    """The error goes up and the interpreter exits (rc 1) with a writer thread still in its write:
    before, the exit joined the stuck ThreadPoolExecutor worker and the async save thread forever
    (here: the subprocess timeout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "STUCK StuckWriteError" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert "has been stuck for" in p.stderr
    assert _steps(tmp_path / "run") == []


def _rank_with_a_stuck_write(rank: int, world: int, root: str) -> list[str]:
    import threading as th

    from trainguard.storage import local as loc

    orig = loc._LocalWriter.pwrite

    def stuck(self, data, offset):  # rank 1's writes of step 2 never return (its process ends with them)
        if "step-000000002" in self.path:
            th.Event().wait()
        return orig(self, data, offset)

    if rank == 1:
        loc._LocalWriter.pwrite = stuck
    seen = []
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, timeout=120.0, handle_signals=False)
    mgr.open()
    mgr.save(1, _state(1.0))
    mgr.wait()
    mgr.timeout = 3.0  # step 2: rank 0's rounds and rank 1's wait give up after 3 s
    mgr.save(2, _state(2.0))
    for call in (mgr.wait, mgr.close):
        try:
            call()
            seen.append("returned")
        except tg.CheckpointError as e:
            seen.append(f"{type(e).__name__}: {str(e)[:300]}")
    return seen


def test_two_ranks_one_stuck_write_every_rank_raises(tmp_path: Path) -> None:
    """Rank 1's write of step 2 never returns: rank 0 fails the save at its round's timeout and
    rank 1 raises StuckWriteError at the same calls (before, rank 1's wait() never returned);
    step 1 stays the newest checkpoint."""
    from dist_helper import run_ranks

    out = [r.value for r in run_ranks(_rank_with_a_stuck_write, 2, str(tmp_path), timeout=120)]
    assert out[0][0].startswith("RankFailureError") and "rank(s) [1]" in out[0][0], out
    assert out[1][0].startswith("StuckWriteError: rank 1: the save of step 2 has been stuck"), out
    assert out[1][1].startswith("StuckWriteError"), out  # close() too: the save is still in flight
    assert _steps(tmp_path) == ["step-000000001"]


def test_write_streams_have_stopped_when_a_ctrl_c_leaves_the_caller() -> None:
    """The write streams are daemon threads (an exit does not join them); a Ctrl-C in the caller's
    wait for them must still find none writing on when it propagates: the caller then closes the
    file, and a descriptor number reused by another open would take a late write."""
    import signal

    from trainguard.streamjobs import run_parallel

    ran: list[int] = []
    main = threading.main_thread().ident
    interrupted = threading.Event()

    def on_sigint(signum, frame):  # the default handler's KeyboardInterrupt, noted for the jobs
        interrupted.set()
        raise KeyboardInterrupt

    def job(k: int):
        def run() -> None:
            ran.append(k)
            if k == 0:
                signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, delivered to the caller's join
            assert interrupted.wait(30)

        return run

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel([job(k) for k in range(50)], 2)
    finally:
        signal.signal(signal.SIGINT, old)
    assert not [t for t in threading.enumerate() if t.name.startswith("trainguard-io") and t.is_alive()]
    assert 0 in ran and set(ran) <= {0, 1}  # each stream stopped after its current job (the second one: if it had started)


def test_ram_tier_copy_to_disk_stuck_is_raised_at_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAM tier's copy of step 1 to the run directory is stuck in a write: the save of step 2
    waited for it with no bound (rank 0, in the training thread). It raises StuckWriteError now,
    with on_error="warn" too; the copy finishes once the write returns, and close() keeps it."""
    root, base = tmp_path / "run", tmp_path / "shm"
    base.mkdir()
    entered, gate = threading.Event(), threading.Event()
    orig = local._LocalWriter.pwrite

    def stuck(self, data, offset):
        if str(root) in self.path:  # the copy to disk, not the save into the RAM tier
            entered.set()
            assert gate.wait(120), "never released"
        return orig(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", stuck)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), on_error="warn", timeout=0.5,
                              handle_signals=False) as mgr:
        try:
            mgr.save(1, _state(1.0))
            assert entered.wait(60)
            with pytest.raises(StuckWriteError, match=r"copying step 1 from the RAM tier to .*run has been stuck for \d+ s "
                               r"in a write of \d+ bytes"):
                mgr.save(2, _state(2.0))
        finally:
            gate.set()
            mgr.timeout = mgr.ram.timeout = 120.0  # close() waits for the released copy: no write is held now
    assert _steps(root) == ["step-000000001"]
    got = _state(0.0)
    tg.load(root / "step-000000001", got)
    assert torch.equal(got["m"].weight, torch.full((4, 4), 1.0))


def test_a_forked_child_inherits_no_storage_call_in_flight(tmp_path: Path) -> None:
    """A DataLoader worker forked while the parent's save thread is inside a write must not count
    that write as its own (it never ends there): its own async save would be declared stuck."""
    from trainguard import iostall

    with iostall.inside("a write of the parent's"):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(w, b"none" if iostall.oldest() is None else b"some")
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 8)
        os.close(r)
        os.waitpid(pid, 0)
        assert iostall.oldest() is not None  # the parent's own record stays
    assert got == b"none"


@pytest.mark.parametrize("second", ["another manager", "a direct save"])
def test_the_next_save_of_another_manager_or_a_direct_one_is_bounded_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         second: str) -> None:
    """One save in flight per process: a model manager's save stuck in a write held the next save of
    an EMA manager (or a direct async tg.save) in its wait for the previous one, with no bound."""
    entered, gate = threading.Event(), threading.Event()
    orig = local._LocalWriter.pwrite

    def stuck(self, data, offset):
        if "model" in self.path:
            entered.set()
            assert gate.wait(120), "never released"
        return orig(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", stuck)
    model = tg.CheckpointManager(tmp_path / "model", save=tg.EveryNSteps(1), async_save=True, timeout=0.5,
                                 handle_signals=False).open()
    try:
        model.save(1, _state(1.0))
        assert entered.wait(60)
        with pytest.raises(StuckWriteError, match=r"the async save of step 1 \(to .*model.*\) has been stuck"):
            if second == "another manager":
                with tg.CheckpointManager(tmp_path / "ema", save=tg.EveryNSteps(1), async_save=True, timeout=0.5,
                                          on_error="warn", handle_signals=False) as ema:
                    ema.save(1, _state(5.0))
            else:
                tg.save(tmp_path / "direct", _state(5.0), async_=True, timeout=0.5)
    finally:
        gate.set()
        model.timeout = 120.0  # close() waits for the released save: no write is held now
        model.close()
    assert _steps(tmp_path / "model") == ["step-000000001"]
