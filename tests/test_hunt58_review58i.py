"""review58i: a hostile review of polish58's ``--json`` errors (one JSON object on stdout).

1. ``trainguard report RUN --json --plot FILE`` printed the summary's JSON, then drew the plot: a plot that
   failed (the disk full: ``plot_written``'s error) or a Ctrl-C while it was drawn printed the error's JSON
   object after the summary, and stdout was two JSON documents (``json.loads``: "Extra data"). The plot is
   now drawn first under ``--json``: stdout holds the summary, or the error object alone.
2. ``trainguard bench --json`` handles its own Ctrl-C (the checkpoints it removed or left): its line went to
   stderr and stdout stayed empty, where every other ``--json`` error is one JSON object on stdout.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard import report as rep
from trainguard import selfbench
from trainguard.cli import main


def _events(run: Path) -> Path:
    lines = [{"t": 1.7e9 + i, "event": "step", "rank": 0, "pid": 1, "step": i + 1, "world_size": 1} for i in range(3)]
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


@pytest.mark.parametrize("exc, code, kind", [(OSError(errno.ENOSPC, "No space left on device"), 2, "command"),
                                             (KeyboardInterrupt(), 130, "interrupted")])
def test_report_json_whose_plot_fails_prints_one_json_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               exc: BaseException, code: int, kind: str) -> None:
    pytest.importorskip("matplotlib")

    def fail(*_a: object, **_k: object) -> None:
        raise exc

    monkeypatch.setattr(rep, "plot_tally", fail)
    r = CliRunner().invoke(main, ["report", str(_events(tmp_path)), "--json", "--plot", str(tmp_path / "t.png")])
    assert r.exit_code == code, r.output
    out = json.loads(r.stdout)  # before: the summary, then the error object ("Extra data")
    assert out["kind"] == kind and out["exit_code"] == code, out


def test_report_json_with_a_plot_prints_the_summary(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = CliRunner().invoke(main, ["report", str(_events(tmp_path)), "--json", "--plot", str(tmp_path / "t.png")])
    assert r.exit_code == 0, r.output
    assert "goodput" in json.loads(r.stdout) and (tmp_path / "t.png").exists()
    assert "timeline written to" in r.stderr


def test_bench_json_interrupted_is_one_json_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(selfbench, "run", interrupted)
    r = CliRunner().invoke(main, ["bench", str(tmp_path), "--size", "1MiB", "--rounds", "1", "--json"])
    assert r.exit_code == 130, r.output
    out = json.loads(r.stdout)  # before: stdout empty, "interrupted: its files are removed" on stderr
    assert out["kind"] == "interrupted" and out["exit_code"] == 130 and "files are removed" in out["error"], out
    r = CliRunner().invoke(main, ["bench", str(tmp_path), "--size", "1MiB", "--rounds", "1"])
    assert r.exit_code == 130 and r.stdout == "" and "interrupted: its files are removed" in r.stderr, r.output
