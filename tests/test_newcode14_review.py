"""Adversarial review of the day's new code (newcode14): system-call errors on the RAM tier's
paths, the one-thread guard, and the other new modules."""

from __future__ import annotations

import errno
import json
import os

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
