"""Session 48's own fixes of items earlier sessions left alone."""

from __future__ import annotations

import os
import signal

import trainguard as tg


def test_bench_keeps_an_inherited_ignored_sigterm_and_finishes(tmp_path, monkeypatch):
    """``trainguard bench`` installed its own SIGTERM handler over one the process inherited as
    ignored (`trap '' TERM`, a launcher that shields its children), so a SIGTERM meant for someone
    else ended the bench with exit 143. ``convert``, ``consolidate``, ``export`` and ``demo`` keep an
    ignored SIGTERM ignored; the bench now uses their installer and does the same."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    real_load = tg.load
    sent = []

    def load(path, state, **kw):  # a SIGTERM in every load of the run: each one ignored
        os.kill(os.getpid(), signal.SIGTERM)
        sent.append(path)
        return real_load(path, state, **kw)

    monkeypatch.setattr(tg, "load", load)
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        res = CliRunner().invoke(cli, ["bench", str(tmp_path), "--size", "2MiB", "--rounds", "1", "--json"],
                                 catch_exceptions=False)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old)
    assert sent, "the bench loaded nothing: the signal was never sent"
    assert res.exit_code == 0, res.output
    assert '"sync_save_s"' in res.stdout
    assert os.listdir(tmp_path) == []


def test_a_manager_save_that_drops_an_entry_is_warned_at_the_save(tmp_path):
    """A save that left out an entry its manager's earlier saves held (a last save of the weights
    alone) was found only at the resume, after the crash: restore() refused the newest checkpoint.
    The save itself now warns, once per drop, naming the entry and the step that last held it; an
    entry added later, or saves that go on without it, are not warned of."""
    import warnings

    import torch

    model, ema = torch.nn.Linear(2, 2), tg.StateDict(decay=0.9)

    def saves(mgr, step, state):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            mgr.save(step, state)
        return [w for w in got if issubclass(w.category, tg.DroppedEntryWarning)]

    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(10)) as mgr:
        assert saves(mgr, 10, {"model": model}) == []
        assert saves(mgr, 20, {"model": model, "ema": ema}) == []  # added: not warned
        dropped = saves(mgr, 30, {"model": model})
        assert len(dropped) == 1, dropped
        text = str(dropped[0].message)
        assert "step 30" in text and "'ema' (last saved at step 20)" in text, text
        assert dropped[0].filename == __file__  # points at the caller's save()
        assert saves(mgr, 40, {"model": model}) == []  # once per drop
        assert saves(mgr, 50, {"model": model, "ema": ema}) == []
        assert "'ema' (last saved at step 50)" in str(saves(mgr, 60, {"model": model})[0].message)
    with tg.CheckpointManager(tmp_path) as mgr:  # what the warning foretells
        try:
            mgr.restore({"model": model, "ema": ema})
        except tg.CheckpointError as e:
            assert "step 50 holds ema" in str(e), e
        else:
            raise AssertionError("restore took a checkpoint without the entry")


def test_plan_without_restart_is_a_usage_error_not_a_traceback():
    """``trainguard plan`` without ``--restart``, which --help marks [required], ended in a
    ``TypeError`` traceback from ``make_plan``: click 8.5 (tested here) takes the explicit ``default=None`` the
    option had as a value, so its required check never fired. Now click's usage error, exit 2."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    res = CliRunner().invoke(cli, ["plan", "--nodes", "8", "--node-mtbf", "30d", "--save-stall", "5s"])
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Missing option '--restart'" in res.output
    ok = CliRunner().invoke(cli, ["plan", "--nodes", "8", "--node-mtbf", "30d", "--save-stall", "5s", "--restart", "5m"])
    assert ok.exit_code == 0, ok.output
    # doctor's copy of the options keeps --restart optional (0 when not given)
    assert CliRunner().invoke(cli, ["doctor", "--help"]).output.count("(default 0)") == 1


def test_plan_every_refuses_a_bare_number_that_is_no_whole_number_of_steps():
    """``--every 1000`` is 1000 steps, but ``--every 1e3`` was read as 1000 seconds and ``--every 1.5``
    as 1.5 seconds: the same kind of input in two units, chosen by how the number was written. A
    bare number must now be a whole number of steps; a duration carries its unit."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    base = ["plan", "--nodes", "8", "--node-mtbf", "30d", "--save-stall", "5s", "--restart", "5m", "--step-time", "2s"]
    for bare in ("1e3", "1.5", "2000.0"):
        res = CliRunner().invoke(cli, [*base, "--every", bare])
        assert res.exit_code == 2 and "steps are a whole number" in res.output, (bare, res.output)
    res = CliRunner().invoke(cli, [*base, "--every", "1000,1.5s,10m", "--json"])
    assert res.exit_code == 0, res.output
    assert {"every 1000 steps", "every 1.5s", "every 10m"} <= set(res.output.replace('"', "\n").split("\n")), res.output


def test_run_with_nnodes_written_with_a_leading_zero_gets_the_c10d_defaults(tmp_path, monkeypatch):
    """``--nnodes 1:01`` is one node at most, as torch reads it (``int``), and torch moves such a
    static rendezvous to c10d; ``launcher.prepare`` compared the text with "1" and so left out
    trainguard's keep-alive defaults for it (review48c's list). ``args.check`` now writes the
    counts back as numbers."""
    from trainguard.elastic.args import check
    from trainguard.elastic.launcher import build_parser, prepare

    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare() writes the agent's environment
    for nnodes in ("1:01", "01", "1"):
        args = build_parser().parse_args(["--nnodes", nnodes, "--run-dir", str(tmp_path / nnodes), "x.py"])
        check(args)
        prepare(args)
        assert args.rdzv_backend == "c10d", (nnodes, args.rdzv_backend)
        assert "keep_alive_interval=1" in args.rdzv_conf, (nnodes, args.rdzv_conf)


def test_disk_full_error_of_a_directory_removed_meanwhile_is_still_a_disk_full_error(tmp_path):
    """``disk_error`` read the free space of the failed file's directory to say how much is free;
    when that directory was gone by then (removed by an operator or a cleanup while the save ran
    out of space), its FileNotFoundError replaced the ENOSPC (review48a's list)."""
    import errno

    from trainguard.storage._diskfull import disk_error

    gone = tmp_path / "removed" / "data-00000.bin"
    err = disk_error(OSError(errno.ENOSPC, "No space left on device"), str(gone), 4096)
    assert isinstance(err, tg.DiskFullError), err
    assert "4096 more bytes were needed" in str(err) and "could not be read" in str(err), err
    here = disk_error(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path / "f.bin"), 1)
    assert "bytes are free" in str(here), here
