"""Session 48, helper racefix: `trainguard verify` (and `ls`) of a run directory whose job's retention
deletes the checkpoints the command listed while it checks them."""

from __future__ import annotations

import json
import shutil

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import inspect as inspect_mod
from trainguard import layout
from trainguard.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _state(s: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16,), float(s))}


def test_verify_lists_again_when_retention_deleted_every_listed_checkpoint(tmp_path, monkeypatch):
    """The job saves steps 3 and 4 (KeepLatest(2) deletes 1 and 2) right after verify listed 1 and 2:
    before, verify printed both DELETED, "no committed checkpoint verified", exit 1, although 3 and 4
    were valid. Now it lists again and verifies them."""
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        saved = []
        nxt = [3]

        def verify_while_the_job_saves(path):
            if not saved:  # the job's next two saves, and their retention, between the listing and the checks
                saved.append(True)
                s = nxt[0]
                m.save(s, _state(s))
                m.save(s + 1, _state(s + 1))
                m.wait()
                nxt[0] += 4
                assert sorted(p.name for p in tmp_path.glob("step-*")) == [layout.step_dir(s), layout.step_dir(s + 1)]
            return real_verify(path)

        real_verify = inspect_mod.verify  # the command imports it from there when it runs
        monkeypatch.setattr(inspect_mod, "verify", verify_while_the_job_saves)
        r = _run("verify", tmp_path, "--json")
        assert r.exit_code == 0, r.output
        assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [
            (1, "deleted"), (2, "deleted"), (3, "valid"), (4, "valid")]
        saved.clear()
        m.save(5, _state(5))
        m.save(6, _state(6))  # 5 and 6 are listed next, and deleted (saves 7 and 8) before they are checked
        r = _run("verify", tmp_path)
        assert r.exit_code == 0, r.output
        assert r.output.count("DELETED") == 2 and r.output.count("OK") == 2, r.output
        assert layout.step_dir(8) in r.output and "no committed checkpoint verified" not in r.output


def test_a_step_listed_half_deleted_and_gone_when_checked_is_deleted_not_incomplete(tmp_path, monkeypatch):
    """Retention removes a checkpoint's manifest first: verify listed step 1 without one (as a crashed
    save) and it was gone when checked. Before, it printed INCOMPLETE, "a save in progress ... or one
    that crashed"; it is DELETED, as one deleted after it was listed with its manifest."""
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in (1, 2):
            m.save(s, _state(s))
    (tmp_path / layout.step_dir(1) / layout.MANIFEST).unlink()  # retention's delete, half done
    real = inspect_mod.list_checkpoints  # the command imports it from there when it runs

    def listed_then_deleted(path, **kw):
        rows = real(path, **kw)
        shutil.rmtree(tmp_path / layout.step_dir(1), ignore_errors=True)  # retention's delete, finished
        return rows

    monkeypatch.setattr(inspect_mod, "list_checkpoints", listed_then_deleted)
    r = _run("verify", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [(1, "deleted"), (2, "valid")]


def test_ls_verify_lists_again_when_retention_deleted_every_listed_checkpoint(tmp_path, monkeypatch):
    """`ls --verify` (list_checkpoints(verify_data=True)) checks each listed step's bytes; the job's
    saves 3 and 4 deleted steps 1 and 2 meanwhile. Before, every row was "deleted" and no row "valid"
    (docs' `max(step of valid rows)` recipe raised); now the newer steps are listed and checked too."""
    real = inspect_mod.verify
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))

        def verify_while_the_job_saves(path):
            if m.last_saved_step == 2:
                m.save(3, _state(3))
                m.save(4, _state(4))
                m.wait()
            return real(path)

        monkeypatch.setattr(inspect_mod, "verify", verify_while_the_job_saves)
        r = _run("ls", tmp_path, "--json", "--verify")
        assert r.exit_code == 0, r.output
        assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [
            (1, "deleted"), (2, "deleted"), (3, "valid"), (4, "valid")]
        rows = inspect_mod.list_checkpoints(tmp_path, verify_data=True)  # the library function, as ls calls it
        assert [(x.step, x.status) for x in rows] == [(3, "valid"), (4, "valid")]


def test_latest_step_lists_again_when_retention_deleted_every_listed_step(tmp_path, monkeypatch):
    """latest_step() lists the step directories, then looks for each one's manifest; the job's saves 3
    and 4 deleted steps 1 and 2 in between. Before, it answered None on a run with two checkpoints."""
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        watcher = tg.CheckpointManager(tmp_path, handle_signals=False)  # a monitor's: not opened, any process
        assert watcher.storage is not m.storage
        real = watcher.storage.listdir

        def listed_while_the_job_saves(path):
            names = real(path)
            if m.last_saved_step == 2:
                m.save(3, _state(3))
                m.save(4, _state(4))
                m.wait()
            return names

        monkeypatch.setattr(watcher.storage, "listdir", listed_while_the_job_saves)
        assert watcher.latest_step() == 4
        (tmp_path / layout.step_dir(9)).mkdir()  # a crashed save's debris, newest: listed twice, not counted
        assert watcher.latest_step() == 4


def test_a_closed_async_manager_is_garbage_collected(tmp_path):
    """The process's last async save stays referenced after close() (async_save._INFLIGHT, for the
    next save's wait and the exit drain); its handle kept the commit callback, whose closure held the
    manager (retention.at_commit): a closed manager, its event log and policies, were never freed."""
    import gc
    import weakref

    from trainguard import async_save

    m = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                             handle_signals=False)
    with m:
        for s in (1, 2, 3):
            last = m.save(s, _state(s))  # held here: the handle no longer holds the manager
    # Session 49: close() drops the process's reference to the ended save too (test_hunt49_leftovers49.py)
    assert async_save._INFLIGHT is None and last is not None and last.done()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [layout.step_dir(2), layout.step_dir(3)]  # retention ran
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
