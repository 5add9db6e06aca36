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
