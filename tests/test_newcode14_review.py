"""Adversarial review of the day's new code (newcode14): system-call errors on the RAM tier's
paths, the one-thread guard, and the other new modules."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

import trainguard as tg
from test_syscall_review import Inject, assert_holds, blank, state_for


def test_ram_tier_save_whose_durable_stat_fails_is_a_checkpoint_error_and_warn_continues(tmp_path):
    """LocalStorage.exists raises EIO/EACCES since 5ae2281. The RAM tier's preflight (rank 0, every
    save: is the step already committed on disk?) let it out bare: ``mgr.save`` raised OSError
    through ``on_error="warn"`` on rank 0 alone (the other ranks waited in the save's first round)."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False, ram_tier=str(ram)) as mgr:
        mgr.save(1, state_for(1))
        with Inject({"stat": 1}, match="step-000000002/manifest.json") as inj, pytest.warns(UserWarning, match="Input/output"):
            assert mgr.save(2, state_for(2)) is None  # warned, training goes on
        assert inj.hits == ["stat"]
        mgr.save(3, state_for(3))
    assert_holds(run / "step-000000003", 3)


def test_ram_tier_replacing_a_step_whose_stat_fails_is_a_checkpoint_error(tmp_path):
    """The same for the removal of a durable copy a rolled-back save replaces (manager.save, rank 0,
    RAM tier or object store): its stat's EIO escaped ``on_error="warn"`` as a bare OSError."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False, ram_tier=str(ram)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), on_error="warn",
                              handle_signals=False, ram_tier=str(ram)) as mgr:
        assert mgr.restore(blank(), step=1) == 1
        with Inject({"stat": 1}, match="step-000000002/manifest.json") as inj, pytest.warns(UserWarning, match="Input/output"):
            assert mgr.save(2, state_for(2)) is None
        assert inj.hits == ["stat"]
        mgr.save(2, state_for(22))  # the retry replaces it
    st = blank()
    tg.load(run / "step-000000002", st)
    assert st["progress"]["step"] == 22
    assert os.path.isdir(run / "step-000000001")


def _failing(monkeypatch, name: str, match: str, err: int = errno.EIO) -> None:
    """Every ``os.<name>`` of a path containing ``match`` fails with ``err`` (a failing sector)."""
    orig = getattr(os, name)

    def f(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if match in str(path):
            raise OSError(err, os.strerror(err), str(path))
        return orig(path, *a, **kw)

    monkeypatch.setattr(os, name, f)


@pytest.mark.parametrize("call", [("open", "step-000000002/manifest.json"), ("stat", "step-000000002/manifest.json"),
                                  ("stat", "step-000000002/data-")])
def test_ls_and_verify_report_a_step_the_medium_cannot_read_and_list_the_others(tmp_path, monkeypatch, call):
    """Since e034424 a medium's read error (EIO) is what is wrong with the checkpoint (verify says
    it; restore tries an older one). One step's manifest or data file failing with EIO ended
    ``trainguard ls RUN``, ``trainguard verify RUN`` and ``trainguard verify STEP`` (the manifest) in
    'error: ... Input/output error', exit 2: no step listed, the good ones neither. EACCES is still the
    command's error (exit 2)."""
    from click.testing import CliRunner

    from trainguard.cli import main
    from trainguard.inspect import list_checkpoints

    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    with monkeypatch.context() as mp:
        _failing(mp, *call)
        rows = {r.step: r for r in list_checkpoints(run)}
        assert [rows[s].status for s in (1, 2, 3)] == ["valid", "corrupt", "valid"]
        assert "Input/output error" in rows[2].detail
        ls = CliRunner().invoke(main, ["ls", "--json", str(run)])
        assert ls.exit_code == 0, ls.output
        assert [r["status"] for r in json.loads(ls.output)] == ["valid", "corrupt", "valid"]
        for target in (run, run / "step-000000002"):
            v = CliRunner().invoke(main, ["verify", "--json", str(target)])
            assert v.exit_code == 1, v.output  # corrupt: a verdict, not the command's error (2)
            got = {os.path.basename(r["path"]): r["status"] for r in json.loads(v.output)}
            assert got.pop("step-000000002") == "corrupt" and set(got.values()) <= {"valid"}
    with monkeypatch.context() as mp:
        _failing(mp, *call, err=errno.EACCES)
        assert CliRunner().invoke(main, ["ls", str(run)]).exit_code == 2
        assert CliRunner().invoke(main, ["verify", str(run)]).exit_code == 2


def test_ctrl_c_before_a_created_save_thread_runs_cancels_that_thread(tmp_path, monkeypatch):
    """b02accf: a KeyboardInterrupt in ``thread.start()`` takes the save out of flight and releases its
    staging pool when ``thread.ident`` is None. But Thread.start creates the OS thread first and then
    waits for it to set its ident: a Ctrl-C landing in that wait, before the new thread got the GIL,
    found ident None while the thread was about to run. It then ran the save that had been dropped:
    committed the checkpoint the caller was told failed, and released the staging pool again, while
    the next save held it (the save after that could stage into the same memory). Modelled here by
    a thread that starts the save thread once the Ctrl-C has been handled."""
    from test_async_review import _state, _step
    from trainguard import async_save, stage

    monkeypatch.setattr(stage, "_DEFAULT", {})
    real = threading.Thread.start
    gate, late = threading.Event(), []

    def start(self):  # noqa: ANN001, ANN202
        if self.name != "trainguard-async-save" or late:
            return real(self)
        late.append((self, threading.Thread(target=lambda: (gate.wait(30), real(self)), daemon=True)))
        real(late[-1][1])
        raise KeyboardInterrupt  # the OS thread exists and will run; it has not set its ident yet

    monkeypatch.setattr(threading.Thread, "start", start)
    state = _state()
    with pytest.raises(KeyboardInterrupt):
        tg.save(tmp_path / "b", state, async_=True)
    assert async_save._INFLIGHT is None and not stage.default_pool().in_use
    _step(state["model"], state["optim"])
    hold, entered = threading.Event(), threading.Event()

    def seam() -> None:  # holds the first save thread to get here (save c's) until `hold`
        if not entered.is_set():
            entered.set()
            hold.wait(30)

    monkeypatch.setattr(async_save, "_before_background_stage", seam)
    h = tg.save(tmp_path / "c", state, async_=True)  # holds the pool until `hold`
    assert entered.wait(30)
    gate.set()
    save_thread, starter = late[0]
    starter.join(30)
    save_thread.join(30)
    assert not save_thread.is_alive()
    try:
        assert stage.default_pool().in_use, "the dropped save's thread released the pool save c holds"
        assert not (tmp_path / "b" / "manifest.json").exists(), "the interrupted save committed anyway"
    finally:
        hold.set()
        h.result(timeout=60)


def test_restore_falls_back_when_the_newest_manifest_cannot_be_read_at_all(tmp_path, monkeypatch):
    """A medium's error reading a checkpoint makes restore try an older one (docs/reliability.md).
    With the newest step's manifest.json failing at every open (EIO), the load's error was skipped
    as promised, but restore then re-read that manifest (loader.touched_tensors, every rank) to see
    what the failed load wrote, and that second EIO escaped bare: the job could not restart though
    step 2 was good."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_for(s))
    with monkeypatch.context() as mp:
        _failing(mp, "open", "step-000000003/manifest.json")
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
            st = blank()
            assert mgr.restore(st) == 2
            assert st["progress"]["step"] == 2
            mgr.save(3, state_for(3))  # replaces the unreadable step
    assert_holds(run / "step-000000003", 3)
